"""Request semantics: what a request means (validation, prompts, sampling, constraints)
and the responses it gets."""
