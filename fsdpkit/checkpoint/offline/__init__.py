"""The offline commands over fsdpkit checkpoints, built on fsdpkit.checkpoint.format: one face
over every format's reader (any_checkpoint.py: `fsdpkit.open_checkpoint`, the tensor table
every format opens into, which diff reads through; diff_names.py: diff by the model's own names
across exports), `convert` as `FORMATS[to].write(open(src))` (formats.py; the options check in
request.py; the writers of full output and fsdpkit's reshard in convert.py, of sharded output in
to_sharded.py, of DeepSpeed output in to_deepspeed.py), verify and inspect (verify.py), and what
`--model` says of a model (model_description.py: asked of a child process). Byte copies over
fragments in bounded memory; none of them imports torch."""
