"""Client of the llm-completions service: the generated stubs (`llmcompletions.v2`) and a small
typed client (`llmcompletions.client`)."""
