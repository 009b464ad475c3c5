"""Offline jobs: LLM Engine's v2 batch completions, run on the replica that took them through
the synchronous call path, at a priority below every interactive call, their finished lines
durable as they finish, resumed after a crash.

`paths` keeps every caller-given path inside the operator's root; `lines` reads and checks a
job's input; `store` keeps jobs and their durable records; `runner` runs a job's lines;
`jobs` is the API's logic over them."""
