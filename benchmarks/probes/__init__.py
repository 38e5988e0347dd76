"""One-question measurements behind a decision in the code or the docs; each module names the
result folder it wrote and takes the same arguments it ran with."""
