import os

# Tests never reach the hub: everything they load is built here or shipped with the project.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One process per run unless a test asks for more: fakes and monkeypatches live in this process only.
os.environ.setdefault("CCQ_EVAL_WORKERS", "1")
