"""Running recipes: assets, the verl subprocess, per-step progress, and the long-tail timeline."""
