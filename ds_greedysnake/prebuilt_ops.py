"""DeepSpeed's native ops that set-up built for an accelerator the DeepSpeed install was not made for.

DeepSpeed imports an op compiled into its install only when the install was made under the accelerator
running now (``OpBuilder.load`` in ``op_builder/builder.py`` compares the recorded ``accelerator_name``);
otherwise it compiles the op at run time. Two kinds of process run under another accelerator than the
install's:

- the optimizer worker, on DeepSpeed's CPU accelerator, beside training on a GPU (an install made there
  records ``cuda``);
- any process, when DeepSpeed came from a wheel built without its ops (``scripts/gpu_check.sh``'s
  offline set-up).

For them set-up compiles the ops with DeepSpeed's own JIT build (``python scripts/native_ops.py build
--accelerator NAME``: the files and flags DeepSpeed would use at run time) into ``folder(NAME)``, one
record per op beside them, and ``deepspeed_compat`` imports them from there instead of compiling.
This module knows the folder and the records; it imports no DeepSpeed.
"""
import importlib.util
import json
import os
import sys
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Optional

# Where set-up puts them: this environment's own folder by default, so that a new venv builds anew.
FOLDER_ENV = "DS_GREEDYSNAKE_OPS_DIR"
_DEFAULT_FOLDER = "ds_greedysnake_ops"


def folder(accelerator: str) -> str:
    """The folder of the ops set-up built for ``accelerator`` (DeepSpeed's accelerator name: cpu, cuda)."""
    root = os.environ.get(FOLDER_ENV) or os.path.join(sys.prefix, _DEFAULT_FOLDER)
    return os.path.join(os.path.abspath(root), accelerator)


@dataclass(frozen=True)
class BuiltOp:
    """One op set-up compiled: the extension module torch built (its file and import name) and what it was
    built against. An op built against another DeepSpeed, torch or Python does not load."""
    name: str
    module: str
    file: str
    deepspeed: str
    torch: str
    python: str

    def mismatch(self, deepspeed: str, torch: str) -> Optional[str]:
        """Why this build cannot be loaded here, or None."""
        if not os.path.isfile(self.file):
            return f"{self.file} is gone"
        built = (self.deepspeed, self.torch, self.python)
        running = (deepspeed, torch, sys.implementation.cache_tag)
        if built != running:
            return (f"built for DeepSpeed {built[0]}, torch {built[1]}, {built[2]}; this is DeepSpeed {running[0]}, "
                    f"torch {running[1]}, {running[2]}")
        return None


def _record_path(accelerator: str, name: str) -> str:
    return os.path.join(folder(accelerator), f"{name}.json")


def record(accelerator: str, op: BuiltOp) -> str:
    """Writes the record of ``op`` (atomically: a concurrent reader sees the old one or the new one)."""
    path = _record_path(accelerator, op.name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as out:
        json.dump(asdict(op), out, indent=1)
    os.replace(path + ".tmp", path)
    return path


def read(accelerator: str, name: str) -> Optional[BuiltOp]:
    """The record set-up left for op ``name`` under ``accelerator``, or None."""
    try:
        with open(_record_path(accelerator, name)) as source:
            return BuiltOp(**json.load(source))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as error:  # a record of another layout: as good as none, and said so
        raise RuntimeError(f"unreadable record {_record_path(accelerator, name)} ({error}): remove it and run "
                           "set-up again") from error


def import_built(op: BuiltOp) -> ModuleType:
    """Imports the extension module of ``op`` from its file, as torch's JIT load does after a build."""
    spec = importlib.util.spec_from_file_location(op.module, op.file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
