"""A model split over several processes: the process group and its collectives (`group`), and
which part of each weight a rank holds (`sharding`). The engine that runs the ranks in lockstep is
`hybridkv.engine.sharded`."""
