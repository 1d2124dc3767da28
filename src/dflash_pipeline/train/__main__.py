"""``python -m dflash_pipeline.train --spec JSON``: one rank of a multi-GPU train job (torchrun starts these)."""

from .job import main

main()
