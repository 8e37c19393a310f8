"""The old path of ``ds_greedysnake.models.export``, kept for user scripts and ``python -m``: importing it
gives that module itself (the same object, so that a patch of one of its names reaches the code using it).
"""
import sys

from .models import export as _moved

if __name__ == "__main__":
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
