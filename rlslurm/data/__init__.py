"""The data layer: a user's files (or the generated arithmetic) -> a layout -> `Sample` rows, for SFT and RL.

    source (jsonl | json | parquet | datasets dir | generated)  ->  layout (verl | trl | columns)  ->  Sample

config.py (`data:` in the job YAML), sample.py (Sample), source.py (files read with Hugging Face `datasets`,
memory-mapped Arrow), layout.py (which columns mean what), table.py (rows of one split as Samples),
splits.py (train / held-out of a job), sampler.py (seeded order; the (epoch, index) a checkpoint saves),
check.py (what `rlslurm validate` and `submit` read of the files before anything runs).
"""
