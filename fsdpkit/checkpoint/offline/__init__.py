"""The offline commands over fsdpkit checkpoints, built on fsdpkit.checkpoint.format: one face
over every format's reader (any_checkpoint.py: `fsdpkit.open_checkpoint`, which diff reads
through; diff_names.py: diff by the model's own names across exports), convert and
reshard (convert.py), `convert` of every source format through one table of which options apply
to which source and target (routes.py) and one function per route (converters.py), verify and
inspect (verify.py), and what `--model` says of a model (model_description.py: asked of a child
process). Byte copies over fragments in bounded memory; none of them imports torch."""
