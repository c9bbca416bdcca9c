"""`ccq-eval lm-eval ...`: lm-eval's own command line, with the `ccq` model registered with lm-eval and
the CCQ model types with transformers' Auto classes (so `--model hf` loads CCQ checkpoints too).

lm-eval has no plugin discovery, so its plain `lm-eval` command knows neither. A model_type nobody
registered (`--model hf`) stops in one line naming fla and the fix (loading.unrecognized_type_error), not with
transformers' advice to upgrade transformers.
"""

from __future__ import annotations

import sys

import typer

from ccq_eval import logs

CONTEXT_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def lm_eval_cli(ctx: typer.Context) -> None:
    """lm-eval's own CLI with the `ccq` model registered, e.g. `ccq-eval lm-eval run --model ccq
    --model_args pretrained=tiny-gla-ccq,max_length=2048 --tasks ccq_s_niah_1 --include_path FOLDER
    --metadata '{"tokenizer": "byt5", "lengths": [1024, 2048]}'`, FOLDER being that of the installed
    package ccq_eval.tasks (`python -c 'import ccq_eval.tasks as t; print(t.__path__[0])'`).
    `--model hf` loads CCQ checkpoints as well.

    lm-eval has no plugin discovery, so its plain `lm-eval` command does not know the `ccq` model.
    """
    from lm_eval.__main__ import cli_evaluate

    import ccq_eval.harness.adapter  # registers the "ccq" model with lm-eval
    import ccq_eval.model.auto  # noqa: F401  (registers ccq_gla / ccq_gated_deltanet with transformers)

    args = list(ctx.args)
    logs.drop_metadata_hint(any(arg.startswith("--metadata") for arg in args))
    logs.hand_over_to_lm_eval()
    if args[:1] == ["run"] and not any(arg.split("=")[0] == "--device" for arg in args):
        import torch

        if not torch.cuda.is_available():  # lm-eval's default device is CUDA, also without one
            args += ["--device", "cpu"]
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except ValueError as error:  # --model hf on a model_type nobody registered: transformers' advice misleads
        from ccq_eval.model.loading import unrecognized_type_error

        one_line = unrecognized_type_error(error)
        if one_line is None:
            raise
        raise one_line from None
