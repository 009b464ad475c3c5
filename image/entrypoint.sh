#!/bin/sh
# The image's entrypoint. Arguments that start with an option or name one of llm-completions'
# commands go to llm-completions (`docker run IMAGE serve --port 50052`, Kubernetes `args:`);
# anything else runs as given (`docker run IMAGE python -m facade.launch ...`). Either way the
# program replaces this shell, so that it is the process `docker stop` and Kubernetes signal.
set -eu

# Files made in the volume are writable by group 0 too: a later container of another user id in
# group 0 (OpenShift gives each namespace its own) can then reuse the caches and prepared models.
umask 0002

case "${1:-serve}" in
    -* | serve | prepare-model) exec llm-completions "$@" ;;
    *) exec "$@" ;;
esac
