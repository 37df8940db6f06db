"""User-facing errors: each carries one readable sentence; the CLI prints it and exits with code 2."""


class Exl2Error(Exception):
    """Base class for errors caused by user input (paths, files, settings), not by bugs."""


class ConfigError(Exl2Error):
    """An invalid setting or an unsupported model configuration."""


class ModelLoadError(Exl2Error):
    """A model directory or weight file that cannot be read."""


class FormatError(Exl2Error):
    """Malformed tensor data in an EXL2, GPTQ or GGUF file."""


class ContextLengthError(Exl2Error):
    """A prompt or job that does not fit in the context window."""
