"""Entry point of a worker rank started by `hybridkv.engine.sharded.start`: reads its launch
arguments (pickled, from the leader, on stdin) and runs the rank until the leader closes."""

import logging
import pickle
import sys

from hybridkv.engine.sharded import _worker_main


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    spec, rank, init_method, threads = pickle.loads(sys.stdin.buffer.read())
    _worker_main(spec, rank, init_method, int(sys.argv[1]), threads)


if __name__ == "__main__":
    main()
