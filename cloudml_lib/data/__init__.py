"""The data path: ER-2 flight files -> preprocessing cache -> training samples."""
