"""Errors the engine raises for bad input. Each names the offending field so that a service can map it
onto its API's error shape without parsing messages."""


class InvalidRequestError(ValueError):
    """A request the engine refuses before doing any work; engine state is unchanged."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # pickled by its fields, not by str(self) (the engine's own process sends them)
        return type(self), (self.field, self.message)


class ContextLengthError(InvalidRequestError):
    """Prompt plus max_tokens does not fit the model's context window."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int):
        super().__init__(
            "max_tokens" if num_prompt_tokens < max_model_len else "prompt",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
            f"{num_prompt_tokens + max_tokens} exceeds the context window of {max_model_len} tokens",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len

    def __reduce__(self):
        return type(self), (self.num_prompt_tokens, self.max_tokens, self.max_model_len)
