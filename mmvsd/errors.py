"""User-facing errors: anything a user can cause ends in one clear message and exit code 2."""


class UserError(Exception):
    """An error caused by user input (bad path, wrong checkpoint, mismatched vocab, ...).

    The CLI prints its message on one line and exits with code 2, without a traceback.
    """
