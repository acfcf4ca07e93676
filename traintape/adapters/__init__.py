"""Framework adapters. Each module imports its framework; nothing here is imported by
``import traintape``."""
