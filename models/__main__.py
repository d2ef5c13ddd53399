"""``python -m models [minilm|smollm2 ...] [--force] [--corpus]``: warm the cache."""
import sys

from .prepare import main

sys.exit(main())
