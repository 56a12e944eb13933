"""Errors that end a command on purpose, as opposed to bugs: the CLI prints their message, not a traceback."""


class RunStopped(RuntimeError):
    """A run stopped itself because continuing could not be trusted (e.g. the stability monitor gave up).

    Its state on disk is intact (the last GOOD checkpoint, metrics, events); `hybridtron` exits with code 3.
    """

    exit_code = 3
