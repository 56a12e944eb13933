"""`hybridtron ladder`: Marin's scaling ladder. Plan isoFLOP rungs over a model family (plan), train them as
ordinary pretraining runs (run), fit the compute-optimal frontier and the loss law and project it (fit)."""
