"""How Envoy picks a replica of a pool.

`prefix` (the default): a completion is keyed by its model and the leading part of its first
prompt (text or token ids), and requests with the same key go to the same replica, whose
prefix cache then already holds that part (a system prompt, few-shot examples, a document, a
conversation so far); a replica loaded beyond a bound passes the key's requests on to another.
The key is computed in Envoy after the transcoder, so REST and native gRPC calls are keyed
alike: Envoy's gRPC field extraction reads `model` and the prompt from the request message, and
a Lua filter turns them into the key header, and the prompt's path (digests of its leading
part at growing depths) into another. Envoy then asks the replica picker (facade/picker), an
external processor, which replica takes the request: the path tells it how much of the prompt
earlier prompts shared and where they went, so that a document's prompts stay together while
instructions that every prompt starts with do not pull all of them onto one replica; new
prefixes are dealt out evenly, and each stays where it went while that replica is within the
load bound. The keyed cluster follows the picker's answer (override-host balancing), and falls
back to Envoy's own consistent hashing of the key with bounded load when the picker has no
answer. The picker runs beside this Envoy, or is one that several Envoys share (`--picker`).

`prefix-hash`: the same keys, balanced by Envoy alone (ring hash on the key with
`hash_balance_factor`). Hashing a few keys over a few replicas is uneven (two keys land on the
same one of two replicas half of the time), which is why `prefix` adds the picker
(docs/benchmarks/routing.md).

`least-request`: every call to the replica with the fewest requests in flight. Calls that have
no key (listing, tokenization) are always balanced this way.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcompletions.v2 import completions_pb2

from facade.addresses import is_ip_address
from facade.envoy_config import (
    DESCRIPTOR_FILE,
    FACADE_DIR,
    PICKER_CLUSTER,
    TRANSCODER,
    connection_manager,
    grpc_cluster,
    http2_options,
    http_filters,
    replica_clusters,
    routes,
)
from facade.picker import CLUSTER_METADATA
from facade.picker.protocol import (
    CANCEL_HEADER,
    DESTINATION_HEADER,
    LB_NAMESPACE,
    LOAD_REPORT_TRAILER,
    REQUEST_ID_HEADER,
    SERVED_KEY,
    SUBSET_NAMESPACE,
)
from plumbing.headers import FANOUT_CONTINUE, FANOUT_HEADER

ROUTING_LUA_FILE = FACADE_DIR / "routing.lua"
SERVED_LUA_FILE = FACADE_DIR / "served_endpoint.lua"
BALANCE_POLICIES = ("prefix", "prefix-hash", "least-request")
PREFIX_HEADER = "x-prefix-key"
PATH_HEADER = "x-prefix-path"
TWIN_SUFFIX = "_prefix"  # a cluster's twin balanced by key
EXTRACTION = "envoy.filters.http.grpc_field_extraction"
ROUTING_FILTER = "llmcompletions.routing"
PICKER_FILTER = "llmcompletions.replica_picker"
SERVED_HEADER_FILTER = "llmcompletions.served_endpoint_header"
SERVED_METADATA_FILTER = "llmcompletions.served_endpoint"
# How long a request waits for the picker's answer before Envoy balances it by hash instead.
PICKER_TIMEOUT = "0.2s"
SERVICE = completions_pb2.DESCRIPTOR.services_by_name["CompletionService"]
CREATE_COMPLETION = SERVICE.methods_by_name["CreateCompletion"].full_name
CREATE_CHAT_COMPLETION = SERVICE.methods_by_name["CreateChatCompletion"].full_name
CANCEL_COMPLETION = SERVICE.methods_by_name["CancelCompletion"].full_name
ADAPTER_METHOD_NAMES = ("LoadLoraAdapter", "UnloadLoraAdapter")
ADAPTER_METHODS = tuple(SERVICE.methods_by_name[name].full_name for name in ADAPTER_METHOD_NAMES)
# Where a prompt's text or token ids sit in its google.protobuf.Value (a string, a list of
# strings, a list of token ids, or a list of token-id lists).
PROMPT_FIELDS = (
    "prompt.string_value",
    "prompt.list_value.values.string_value",
    "prompt.list_value.values.number_value",
    "prompt.list_value.values.list_value.values.number_value",
)

# A conversation's messages with text content, in order: its turns share a leading part, so
# that a conversation stays on the replica whose cache holds its earlier turns.
MESSAGE_FIELDS = ("messages.content.string_value",)


@dataclass(frozen=True)
class PrefixAffinity:
    """The key's length (for Envoy's hashing: prefix-hash, and prefix while its picker is
    away), and the load bound: a replica takes a prefix's requests while its requests in
    flight stay within `balance_factor` percent of the pool's average."""

    # Measured with the picker keyed by one key (docs/benchmarks/routing-keys.md): a key must
    # reach past the part every prompt shares (150 tokens of instructions: 256 bytes or 64 ids
    # put them all on one replica) and stop within the part worth keeping together (4096 bytes
    # or 1024 ids gave each 600-token document's prompts keys of their own, spread as least
    # request spreads them); 1024 bytes and 256 ids did neither there.
    chars: int = 1024  # of a text prompt
    tokens: int = 256  # of a token-id prompt
    # Measured with make bench-routing (docs/benchmarks/routing.md): 125 kept the most cache
    # hits under cache pressure and still spread a hot prefix; 100 spilled too early, 150 too
    # late (Envoy counts a replica overloaded only past ceil(factor x (all in flight + 1)) /
    # replicas).
    balance_factor: int = 125
    # Ask the replica picker (prefix) or leave it to Envoy's hashing alone (prefix-hash).
    picker: bool = True


def methods_with_model() -> list[str]:
    """The fully qualified methods whose request names a model, from the proto."""
    return [
        method.full_name
        for method in SERVICE.methods
        if "model" in method.input_type.fields_by_name
    ]


def extracted_fields(by_model: bool, affinity: PrefixAffinity | None) -> dict[str, list[str]]:
    """The request fields Envoy reads, by method: `model` to route between pools, and a
    completion's model and prompt, or a chat's model and messages, for its key."""
    fields: dict[str, list[str]] = {}
    if by_model:
        fields = {method: ["model"] for method in methods_with_model()}
        # An adapter's load or unload goes to the pool its name belongs to (--pool-adapters).
        fields.update({method: ["lora_name"] for method in ADAPTER_METHODS})
    if affinity is not None:
        fields[CREATE_COMPLETION] = ["model", *PROMPT_FIELDS]
        fields[CREATE_CHAT_COMPLETION] = ["model", *MESSAGE_FIELDS]
    if fields:  # the picker's, for a cancel: its request id (and its model, for its pool)
        fields[CANCEL_COMPLETION] = ["model", "request_id"] if by_model else ["request_id"]
    return fields


def routing_lua(affinity: PrefixAffinity | None) -> str:
    """routing.lua, with the key's lengths (0: no key), and whether to compute the prompt's
    path for the picker, set ahead of it."""
    chars, tokens = (affinity.chars, affinity.tokens) if affinity else (0, 0)
    path = "true" if affinity is not None and affinity.picker else "false"
    return (
        f"PREFIX_CHARS = {chars}\nPREFIX_TOKENS = {tokens}\nPREFIX_PATH = {path}\n"
        f"{ROUTING_LUA_FILE.read_text()}"
    )


def install_routing_filters(
    config: dict[str, Any], by_model: bool, affinity: PrefixAffinity | None
) -> None:
    """After the transcoder (REST calls are gRPC by then), before the router: read the
    fields, then set the headers the routes match and hash on."""
    fields = extracted_fields(by_model, affinity)
    if not fields:
        return
    filters = http_filters(config)
    after_transcoder = [f["name"] for f in filters].index(TRANSCODER) + 1
    filters[after_transcoder:after_transcoder] = [
        {
            "name": EXTRACTION,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http."
                "grpc_field_extraction.v3.GrpcFieldExtractionConfig",
                "descriptor_set": {"filename": str(DESCRIPTOR_FILE)},
                "extractions_by_method": {
                    method: {"request_field_extractions": {name: {} for name in names}}
                    for method, names in fields.items()
                },
            },
        },
        {
            "name": ROUTING_FILTER,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": routing_lua(affinity)},
            },
        },
    ]


def ring_hash_policy(affinity: PrefixAffinity) -> dict[str, Any]:
    return {
        "typed_extension_config": {
            "name": "envoy.load_balancing_policies.ring_hash",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
                "ring_hash.v3.RingHash",
                "consistent_hashing_lb_config": {"hash_balance_factor": affinity.balance_factor},
            },
        }
    }


def picked_policy(fallback: dict[str, Any]) -> dict[str, Any]:
    """The replicas the picker named, in order (one per try of the request), then `fallback`."""
    return {
        "typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
                "override_host.v3.OverrideHost",
                "override_host_sources": [
                    {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
                    {"header": DESTINATION_HEADER},
                ],
                "fallback_policy": {"policies": [fallback]},
            },
        }
    }


def twin_name(cluster: str) -> str:
    """The name of a cluster's twin balanced by key."""
    return f"{cluster}{TWIN_SUFFIX}"


def prefix_cluster(cluster: dict[str, Any], affinity: PrefixAffinity) -> dict[str, Any]:
    """The same replicas, health checks and outlier detection, balanced by key."""
    twin = copy.deepcopy(cluster)
    twin["name"] = twin_name(cluster["name"])
    twin["load_assignment"]["cluster_name"] = twin["name"]
    hashed = ring_hash_policy(affinity)
    twin["load_balancing_policy"] = {
        "policies": [picked_policy(hashed) if affinity.picker else hashed]
    }
    return twin


# A retry after a failed connection must not land on the same replica. The ring tries the
# entries after the key's one by one, several of which can belong to the failed replica (one key
# in eight failed all three default tries, with two replicas). And bounded load prefers the
# replica with the fewest requests in flight, which a replica that just died always is, until
# outlier detection ejects it after 5 failed connections: keyed calls get enough retries for
# that (a request sent 0.07 s after a replica's SIGKILL failed with 2).
KEYED_HOST_SELECTION_ATTEMPTS = 16
KEYED_RETRIES = 5


def keyed_route(route: dict[str, Any]) -> dict[str, Any]:
    """The route's calls that carry a key: to its cluster's twin, hashed on the key."""
    keyed = copy.deepcopy(route)
    keyed["match"]["headers"] = [
        *keyed["match"].get("headers", []),
        {"name": PREFIX_HEADER, "present_match": True},
    ]
    keyed["route"]["cluster"] = twin_name(route["route"]["cluster"])
    keyed["route"]["hash_policy"] = [{"header": {"header_name": PREFIX_HEADER}}]
    retries = keyed["route"].get("retry_policy")
    if retries is not None:
        retries["host_selection_retry_max_attempts"] = KEYED_HOST_SELECTION_ATTEMPTS
        retries["num_retries"] = KEYED_RETRIES
    return keyed


# Retries that go at once to a replica not yet tried (cancels and fan-outs ask each in turn).
NEXT_HOST_AT_ONCE: dict[str, Any] = {
    "retry_back_off": {"base_interval": "0.001s", "max_interval": "0.01s"},
    "retry_host_predicate": [
        {
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts."
                "v3.PreviousHostsPredicate"
            },
        }
    ],
}

# A cancel asks the replica the picker names first, then the others, one by one, while each
# answers NOT_FOUND (it does not hold the request): every replica of a pool listed by address,
# up to this many of one named by DNS (or of several pools).
CANCEL_ATTEMPTS = 32
CANCEL_PATH = f"/{SERVICE.full_name}/CancelCompletion"
GRPC_NOT_FOUND = "5"


def cancel_attempts(cluster: dict[str, Any]) -> int:
    """The replicas a cancel may have to ask: those the cluster lists, if it lists them all."""
    if cluster.get("type") == "STRICT_DNS" or "load_assignment" not in cluster:
        return CANCEL_ATTEMPTS
    return sum(len(group["lb_endpoints"]) for group in cluster["load_assignment"]["endpoints"])


def cancel_route(route: dict[str, Any], cluster: str, attempts: int) -> dict[str, Any]:
    """The route's CancelCompletion calls: to `cluster`, retried on the next replica while one
    answers NOT_FOUND."""
    cancel = copy.deepcopy(route)
    cancel["match"].pop("prefix", None)
    cancel["match"]["path"] = CANCEL_PATH
    cancel["route"]["cluster"] = cluster
    cancel["route"].pop("hash_policy", None)
    cancel["route"]["retry_policy"] = {
        "retry_on": "retriable-headers,connect-failure,refused-stream,reset-before-request,"
        "unavailable",
        "retriable_headers": [{"name": "grpc-status", "string_match": {"exact": GRPC_NOT_FOUND}}],
        "num_retries": attempts - 1,
        **copy.deepcopy(NEXT_HOST_AT_ONCE),
        "host_selection_retry_max_attempts": KEYED_HOST_SELECTION_ATTEMPTS,
    }
    return cancel


# The request's model, as routing.lua sets it (pools route on it; the picker sends an adapter's
# prompts where the adapter is resident).
MODEL_HEADER = "x-model"

# A load or unload of an adapter is tried on each replica of the pool in turn: each answers
# with FANOUT_HEADER "continue", and Envoy retries on a replica not yet tried (choosing among
# those left up to FANOUT_HOST_SELECTION_ATTEMPTS times, enough for a pool of dozens), until a
# replica asked again answers without it, with the count of replicas that did it.
FANOUT_PATHS = tuple(f"/{SERVICE.full_name}/{name}" for name in ADAPTER_METHOD_NAMES)
FANOUT_HOST_SELECTION_ATTEMPTS = 100


def fanout_route(route: dict[str, Any], cluster: str, path: str, replicas: int) -> dict[str, Any]:
    """The route's calls on `path`: to every replica of `cluster` in turn."""
    fanout = copy.deepcopy(route)
    fanout["match"].pop("prefix", None)
    fanout["match"]["path"] = path
    fanout["route"]["cluster"] = cluster
    fanout["route"].pop("hash_policy", None)
    fanout["route"]["retry_policy"] = {
        "retry_on": "retriable-headers",
        "retriable_headers": [{"name": FANOUT_HEADER, "string_match": {"exact": FANOUT_CONTINUE}}],
        "num_retries": replicas,  # one more than the replicas: the last finds one asked
        **copy.deepcopy(NEXT_HOST_AT_ONCE),
        "host_selection_retry_max_attempts": FANOUT_HOST_SELECTION_ATTEMPTS,
    }
    fanout["request_headers_to_add"] = [
        {
            "header": {"key": FANOUT_HEADER, "value": "1"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
    ]
    return fanout


def add_cancel_routes(config: dict[str, Any], picked: bool) -> None:
    """Each route to replicas is preceded by one for cancels, to the same replicas: through
    the picker's twin when `picked` (the picker knows which replica holds the request), else
    the cluster itself; and by those of adapter loads and unloads, to each of its replicas."""
    clusters = {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}
    all_routes = routes(config)
    with_cancels = []
    for route in all_routes:
        name = route.get("route", {}).get("cluster")
        if name is not None and not name.endswith(TWIN_SUFFIX):
            target = twin_name(name) if picked and twin_name(name) in clusters else name
            attempts = cancel_attempts(clusters[name])
            with_cancels.append(cancel_route(route, target, attempts))
            with_cancels += [fanout_route(route, name, path, attempts) for path in FANOUT_PATHS]
        with_cancels.append(route)
    all_routes[:] = with_cancels
    # Each fan-out attempt tells the replica its number (the count it reports).
    connection_manager(config)["route_config"]["virtual_hosts"][0][
        "include_request_attempt_count"
    ] = True


def add_prefix_affinity(config: dict[str, Any], affinity: PrefixAffinity) -> None:
    """Each cluster of replicas gets a twin balanced by key; each route to one of them is
    preceded by the same route for calls with a key, to the twin."""
    originals = replica_clusters(config)
    config["static_resources"]["clusters"].extend(
        prefix_cluster(cluster, affinity) for cluster in originals
    )
    names = {cluster["name"] for cluster in originals}
    all_routes = routes(config)
    all_routes[:] = [
        keyed
        for route in all_routes
        for keyed in (
            [keyed_route(route), route]
            if route.get("route", {}).get("cluster") in names
            else [route]
        )
    ]


def picker_route_config(route: dict[str, Any]) -> dict[str, Any]:
    """Keyed routes tell the picker their cluster; other calls skip it."""
    cluster = route.get("route", {}).get("cluster", "")
    keyed = cluster.endswith(TWIN_SUFFIX)
    per_route: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
    }
    if keyed:
        per_route["overrides"] = {
            "grpc_initial_metadata": [{"key": CLUSTER_METADATA, "value": cluster}]
        }
    else:
        per_route["disabled"] = True
    return per_route


PickerAddress = Path | tuple[str, int]  # beside Envoy: a Unix socket; shared: HOST:PORT


def picker_endpoint(picker: PickerAddress) -> dict[str, Any]:
    if isinstance(picker, Path):
        return {"address": {"pipe": {"path": str(picker)}}}
    host, port = picker
    return {"address": {"socket_address": {"address": host, "port_value": port}}}


def picker_cluster(picker: PickerAddress) -> dict[str, Any]:
    """The picker, reached over HTTP/2: beside Envoy on a Unix socket, or a shared one by its
    address (a name, such as a Kubernetes Service, resolved by DNS)."""
    by_name = not isinstance(picker, Path) and not is_ip_address(picker[0])
    return grpc_cluster(PICKER_CLUSTER, picker_endpoint(picker), by_name)


def picker_filter() -> dict[str, Any]:
    """The external processor that asks the picker; if it does not answer in time, the call
    goes on without (fail open)."""
    # The request's headers, to pick; the response's headers (with the replica that served it)
    # and trailers (gRPC's, before the transcoder on the way back, so REST calls have them too,
    # with the replica's load report) keep the picker's call open until the request ends,
    # which is how the picker counts each replica's requests in flight.
    processing_mode = {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SEND",
        "request_body_mode": "NONE",
        "response_body_mode": "NONE",
    }
    # The picker needs these alone: callers' credentials and the rest of their headers stay
    # in Envoy, even when the picker is across the network.
    forwarded = [PATH_HEADER, CANCEL_HEADER, REQUEST_ID_HEADER, LOAD_REPORT_TRAILER, MODEL_HEADER]
    return {
        "name": PICKER_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
            "ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}},
            "failure_mode_allow": True,
            "message_timeout": PICKER_TIMEOUT,
            "processing_mode": processing_mode,
            "forward_rules": {
                "allowed_headers": {"patterns": [{"exact": name} for name in forwarded]}
            },
            # The endpoint picker protocol's metadata: a gateway's subset hint and the served
            # endpoint go to the picker; its pick comes back in envoy.lb.
            "metadata_options": {
                "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE, LB_NAMESPACE]},
                "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
            },
        },
    }


def served_endpoint_filters() -> list[dict[str, Any]]:
    """Between the picker's filter and the router: the upstream host that served a request
    into envoy.lb's x-gateway-destination-endpoint-served (facade/served_endpoint.lua), where
    the picker's filter, next on the way back, forwards it."""
    return [
        {
            "name": SERVED_METADATA_FILTER,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": SERVED_LUA_FILE.read_text()},
            },
        },
        {
            "name": SERVED_HEADER_FILTER,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation."
                "v3.HeaderMutation",
                "mutations": {
                    "response_mutations": [
                        {
                            "append": {
                                "header": {"key": SERVED_KEY, "value": "%UPSTREAM_HOST%"},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                            }
                        }
                    ]
                },
            },
        },
    ]


def add_replica_picker(config: dict[str, Any], picker: PickerAddress) -> None:
    """Envoy asks the picker at `picker` about each keyed call, after the key is set and before
    the router."""
    cluster = picker_cluster(picker)
    # Each keyed request holds its picker stream for its whole life: the picker takes as many
    # at once as the replicas do (past Envoy's default 1,024 the call would go unpicked).
    cluster["circuit_breakers"] = copy.deepcopy(replica_clusters(config)[0]["circuit_breakers"])
    if not isinstance(picker, Path):
        # Across a network, the replicas' pings: a picker that vanished without closing is
        # noticed, rather than each keyed call waiting PICKER_TIMEOUT on a dead connection
        # until TCP gives up.
        keepalive = http2_options(replica_clusters(config)[0])["connection_keepalive"]
        http2_options(cluster)["connection_keepalive"] = copy.deepcopy(keepalive)
    config["static_resources"]["clusters"].append(cluster)
    filters = http_filters(config)
    after_key = [f["name"] for f in filters].index(ROUTING_FILTER) + 1
    filters[after_key:after_key] = [picker_filter(), *served_endpoint_filters()]
    for route in routes(config):
        route.setdefault("typed_per_filter_config", {})[PICKER_FILTER] = picker_route_config(route)
