"""``python -m models [NAME ...] [--force] [--corpus]``: warm the cache (see models.prepare.main)."""
import sys

from .prepare import main

sys.exit(main())
