"""CUDA-graph replay of recurrent decode steps (`decode`) and of the adapter's scoring forwards (`score`)."""
