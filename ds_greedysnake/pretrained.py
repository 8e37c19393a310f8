"""The old path of ``ds_greedysnake.models.pretrained``, kept for user scripts: importing it
gives that module itself (the same object, so that a patch of one of its names reaches the code using it).
"""
import sys

from .models import pretrained as _moved

sys.modules[__name__] = _moved
