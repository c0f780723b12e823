"""The export-folder format: manifest and artifacts, trust checks, staging under temporary names."""
