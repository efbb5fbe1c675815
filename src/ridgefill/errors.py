"""The one error type a user sees: a one-line message that names the problem and the fix."""


class RidgefillError(Exception):
    """Bad input or an unusable artifact. The CLI prints `error: <message>` and exits with code 2."""
