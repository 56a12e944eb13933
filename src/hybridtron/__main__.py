"""`python -m hybridtron ...` is the `hybridtron` command; torchrun launches it this way on every rank:
`torchrun --nproc-per-node N -m hybridtron pretrain ...`."""

import sys

from hybridtron.cli import main

sys.exit(main())
