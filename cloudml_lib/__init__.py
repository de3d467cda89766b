"""CloudML: cloud base height from ER-2 thermal-IR frame sequences, trained on a small GPU."""
from cloudml_lib.config import Config, load_config
from cloudml_lib.errors import CloudMLError, ConfigError, DataError

__version__ = "0.1.0"
__all__ = ["Config", "load_config", "CloudMLError", "ConfigError", "DataError", "__version__"]
