"""``python -m fastdeploy_kvcache.entrypoints.router``."""

import sys

from fastdeploy_kvcache.entrypoints.router.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
