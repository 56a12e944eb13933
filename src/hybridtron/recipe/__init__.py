"""Nemotron 3 Ultra's training recipe as typed stages: `hybridtron pipeline` (pipeline.py) runs pretraining, SFT,
RLVR, the teachers, the MOPD warmup and iterations and MTP boosting, each stage a run of its command's library
(the run configuration dataclass the command takes, trained by its `RunCommand`) and one declaration (stages.py;
what a declaration holds: stage.py), each stage's model measured the same way (evaluation.py), and the whole drawn
as a table and a page (render.py)."""
