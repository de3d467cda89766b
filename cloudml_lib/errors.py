"""Exceptions a user can cause. The CLI prints these as one short message and exits with status 2."""


class CloudMLError(Exception):
    """A problem the user can fix (config, data, paths); the message says what and how."""


class ConfigError(CloudMLError):
    """A config file or override is invalid."""


class DataError(CloudMLError):
    """A flight file, key or value is missing or unusable."""
