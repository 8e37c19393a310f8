"""Entry point of the optimizer worker process (a module of its own, so that the task and result
classes it exchanges pickle under their real module name, not ``__main__``)."""
import sys

from ds_greedysnake.optim.updates import worker_main

if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]))
