"""Synthetic long-tail arithmetic task for GRPO on a tiny CPU model.

Submodules: ``longtail`` (problem generator, verl parquet I/O), ``reward`` (verl custom reward
function), ``tokenizer`` (local byte-level BPE saved as Qwen2), ``tiny_model`` (random Qwen2),
``sft`` (warm-start training) and ``prepare`` (cached end-to-end build + quick evaluation).
"""
from .longtail import DATA_SOURCE, Problem, make_problem, read_rows, sample_num_steps, write_parquet
from .reward import compute_score

__all__ = ["DATA_SOURCE", "Problem", "compute_score", "make_problem", "read_rows", "sample_num_steps", "write_parquet"]
