"""Images in chat messages: which ones a request may name (`parts`), and the fetcher vLLM's
renderer reads them through (`connector`), which keeps every caller-given URL to what the
operator allowed (`addresses`), bounds each download (`download`) and each image's declared
size (`images`). Every refusal is a MediaRefusedError (`refusal`): a 4xx that says what to
change, never a 500."""
