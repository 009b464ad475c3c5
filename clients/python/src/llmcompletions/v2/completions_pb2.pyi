from google.api import annotations_pb2 as _annotations_pb2
from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor
ALLOWED_FIELD_NUMBER: _ClassVar[int]
allowed: _descriptor.FieldDescriptor

class NumericRange(_message.Message):
    __slots__ = ("min", "min_exclusive", "max", "max_exclusive")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MIN_EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    MAX_EXCLUSIVE_FIELD_NUMBER: _ClassVar[int]
    min: float
    min_exclusive: bool
    max: float
    max_exclusive: bool
    def __init__(self, min: _Optional[float] = ..., min_exclusive: _Optional[bool] = ..., max: _Optional[float] = ..., max_exclusive: _Optional[bool] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "load_inplace")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_INPLACE_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    load_inplace: bool
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., load_inplace: _Optional[bool] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("lora_name", "object", "replicas")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    object: str
    replicas: int
    def __init__(self, lora_name: _Optional[str] = ..., object: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ("lora_name", "object", "replicas")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    object: str
    replicas: int
    def __init__(self, lora_name: _Optional[str] = ..., object: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class CancelCompletionRequest(_message.Message):
    __slots__ = ("request_id", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class CancelCompletionResponse(_message.Message):
    __slots__ = ("request_id", "object", "cancelled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    object: str
    cancelled: int
    def __init__(self, request_id: _Optional[str] = ..., object: _Optional[str] = ..., cancelled: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("object", "data")
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    object: str
    data: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, object: _Optional[str] = ..., data: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("id", "object", "created", "owned_by", "parent", "max_model_len")
    ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    OWNED_BY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    id: str
    object: str
    created: int
    owned_by: str
    parent: _struct_pb2.Value
    max_model_len: int
    def __init__(self, id: _Optional[str] = ..., object: _Optional[str] = ..., created: _Optional[int] = ..., owned_by: _Optional[str] = ..., parent: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("id", "object", "created", "owned_by", "parent", "max_model_len", "vocab_size", "eos_token_ids", "structured_outputs_backend", "default_sampling", "adapters")
    ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    OWNED_BY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    id: str
    object: str
    created: int
    owned_by: str
    parent: _struct_pb2.Value
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    structured_outputs_backend: str
    default_sampling: _struct_pb2.Struct
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., object: _Optional[str] = ..., created: _Optional[int] = ..., owned_by: _Optional[str] = ..., parent: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., structured_outputs_backend: _Optional[str] = ..., default_sampling: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "prompt", "add_special_tokens", "messages", "add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: _struct_pb2.Value
    add_special_tokens: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    continue_final_message: bool
    tools: _containers.RepeatedCompositeFieldContainer[ChatTool]
    chat_template_kwargs: _struct_pb2.Struct
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., tools: _Optional[_Iterable[_Union[ChatTool, _Mapping]]] = ..., chat_template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens", "count", "max_model_len", "counts")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    count: int
    max_model_len: int
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., max_model_len: _Optional[int] = ..., counts: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("model", "tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("prompt",)
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    def __init__(self, prompt: _Optional[str] = ...) -> None: ...

class CreateCompletionRequest(_message.Message):
    __slots__ = ("model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs", "echo", "stop", "presence_penalty", "frequency_penalty", "best_of", "logit_bias", "seed", "suffix", "user", "top_k", "min_p", "repetition_penalty", "use_beam_search", "length_penalty", "early_stopping", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "add_special_tokens", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "return_token_ids", "return_tokens_as_token_ids", "prompt_logprobs", "truncate_prompt_tokens", "truncation_side", "priority", "allowed_token_ids", "return_metrics")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    USE_BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    GUIDED_JSON_FIELD_NUMBER: _ClassVar[int]
    GUIDED_REGEX_FIELD_NUMBER: _ClassVar[int]
    GUIDED_CHOICE_FIELD_NUMBER: _ClassVar[int]
    GUIDED_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GUIDED_DECODING_BACKEND_FIELD_NUMBER: _ClassVar[int]
    GUIDED_WHITESPACE_PATTERN_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKENS_AS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_METRICS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: _struct_pb2.Value
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    stream: bool
    stream_options: StreamOptions
    logprobs: int
    echo: bool
    stop: _struct_pb2.Value
    presence_penalty: float
    frequency_penalty: float
    best_of: int
    logit_bias: _containers.ScalarMap[int, float]
    seed: int
    suffix: str
    user: str
    top_k: int
    min_p: float
    repetition_penalty: float
    use_beam_search: bool
    length_penalty: float
    early_stopping: _struct_pb2.Value
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    min_tokens: int
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    add_special_tokens: bool
    response_format: ResponseFormat
    guided_json: _struct_pb2.Struct
    guided_regex: str
    guided_choice: _struct_pb2.ListValue
    guided_grammar: str
    guided_decoding_backend: str
    guided_whitespace_pattern: str
    return_token_ids: bool
    return_tokens_as_token_ids: bool
    prompt_logprobs: int
    truncate_prompt_tokens: int
    truncation_side: str
    priority: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    return_metrics: bool
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., n: _Optional[int] = ..., stream: _Optional[bool] = ..., stream_options: _Optional[_Union[StreamOptions, _Mapping]] = ..., logprobs: _Optional[int] = ..., echo: _Optional[bool] = ..., stop: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., best_of: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., seed: _Optional[int] = ..., suffix: _Optional[str] = ..., user: _Optional[str] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., use_beam_search: _Optional[bool] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., add_special_tokens: _Optional[bool] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., guided_json: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., guided_regex: _Optional[str] = ..., guided_choice: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., guided_grammar: _Optional[str] = ..., guided_decoding_backend: _Optional[str] = ..., guided_whitespace_pattern: _Optional[str] = ..., return_token_ids: _Optional[bool] = ..., return_tokens_as_token_ids: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., truncate_prompt_tokens: _Optional[int] = ..., truncation_side: _Optional[str] = ..., priority: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., return_metrics: _Optional[bool] = ...) -> None: ...

class StreamOptions(_message.Message):
    __slots__ = ("include_usage", "continuous_usage_stats")
    INCLUDE_USAGE_FIELD_NUMBER: _ClassVar[int]
    CONTINUOUS_USAGE_STATS_FIELD_NUMBER: _ClassVar[int]
    include_usage: bool
    continuous_usage_stats: bool
    def __init__(self, include_usage: _Optional[bool] = ..., continuous_usage_stats: _Optional[bool] = ...) -> None: ...

class CreateChatCompletionRequest(_message.Message):
    __slots__ = ("model", "messages", "max_completion_tokens", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs", "top_logprobs", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "user", "tools", "tool_choice", "parallel_tool_calls", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "return_token_ids", "truncate_prompt_tokens", "priority", "add_generation_prompt", "continue_final_message", "echo", "add_special_tokens", "chat_template_kwargs", "documents", "chat_template", "return_metrics")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    GUIDED_JSON_FIELD_NUMBER: _ClassVar[int]
    GUIDED_REGEX_FIELD_NUMBER: _ClassVar[int]
    GUIDED_CHOICE_FIELD_NUMBER: _ClassVar[int]
    GUIDED_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GUIDED_DECODING_BACKEND_FIELD_NUMBER: _ClassVar[int]
    GUIDED_WHITESPACE_PATTERN_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    RETURN_METRICS_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_completion_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    stream: bool
    stream_options: StreamOptions
    logprobs: bool
    top_logprobs: int
    stop: _struct_pb2.Value
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    seed: int
    user: str
    tools: _containers.RepeatedCompositeFieldContainer[ChatTool]
    tool_choice: _struct_pb2.Value
    parallel_tool_calls: bool
    top_k: int
    min_p: float
    repetition_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    min_tokens: int
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_format: ResponseFormat
    guided_json: _struct_pb2.Struct
    guided_regex: str
    guided_choice: _struct_pb2.ListValue
    guided_grammar: str
    guided_decoding_backend: str
    guided_whitespace_pattern: str
    return_token_ids: bool
    truncate_prompt_tokens: int
    priority: int
    add_generation_prompt: bool
    continue_final_message: bool
    echo: bool
    add_special_tokens: bool
    chat_template_kwargs: _struct_pb2.Struct
    documents: _struct_pb2.ListValue
    chat_template: str
    return_metrics: bool
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_completion_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., n: _Optional[int] = ..., stream: _Optional[bool] = ..., stream_options: _Optional[_Union[StreamOptions, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., stop: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., seed: _Optional[int] = ..., user: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[ChatTool, _Mapping]]] = ..., tool_choice: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., guided_json: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., guided_regex: _Optional[str] = ..., guided_choice: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., guided_grammar: _Optional[str] = ..., guided_decoding_backend: _Optional[str] = ..., guided_whitespace_pattern: _Optional[str] = ..., return_token_ids: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., echo: _Optional[bool] = ..., add_special_tokens: _Optional[bool] = ..., chat_template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., documents: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., chat_template: _Optional[str] = ..., return_metrics: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _struct_pb2.Value
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ChatToolCall]
    tool_call_id: str
    reasoning_content: str
    reasoning: str
    parts: _containers.RepeatedCompositeFieldContainer[ChatContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ChatToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., reasoning_content: _Optional[str] = ..., reasoning: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ChatContentPart, _Mapping]]] = ...) -> None: ...

class ChatContentPart(_message.Message):
    __slots__ = ("text", "image_url", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_URL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image_url: str
    image: ChatImage
    def __init__(self, text: _Optional[str] = ..., image_url: _Optional[str] = ..., image: _Optional[_Union[ChatImage, _Mapping]] = ...) -> None: ...

class ChatImage(_message.Message):
    __slots__ = ("data", "mime_type")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ...) -> None: ...

class ChatTool(_message.Message):
    __slots__ = ("type", "function")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    type: str
    function: ChatFunction
    def __init__(self, type: _Optional[str] = ..., function: _Optional[_Union[ChatFunction, _Mapping]] = ...) -> None: ...

class ChatFunction(_message.Message):
    __slots__ = ("name", "description", "parameters", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: _struct_pb2.Struct
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., strict: _Optional[bool] = ...) -> None: ...

class ChatToolCall(_message.Message):
    __slots__ = ("id", "type", "function", "index")
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: str
    function: ChatFunctionCall
    index: int
    def __init__(self, id: _Optional[str] = ..., type: _Optional[str] = ..., function: _Optional[_Union[ChatFunctionCall, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class ChatFunctionCall(_message.Message):
    __slots__ = ("name", "arguments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments: str
    def __init__(self, name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class CreateChatCompletionResponse(_message.Message):
    __slots__ = ("id", "object", "created", "model", "choices", "usage", "system_fingerprint", "error", "prompt_token_ids", "metrics")
    ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    id: str
    object: str
    created: int
    model: str
    choices: _containers.RepeatedCompositeFieldContainer[ChatChoice]
    usage: Usage
    system_fingerprint: str
    error: StreamError
    prompt_token_ids: _struct_pb2.ListValue
    metrics: RequestMetrics
    def __init__(self, id: _Optional[str] = ..., object: _Optional[str] = ..., created: _Optional[int] = ..., model: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[ChatChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., system_fingerprint: _Optional[str] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ...) -> None: ...

class ChatChoice(_message.Message):
    __slots__ = ("index", "message", "delta", "finish_reason", "stop_reason", "logprobs", "token_ids")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    message: ChatReplyMessage
    delta: ChatReplyMessage
    finish_reason: str
    stop_reason: _struct_pb2.Value
    logprobs: ChatLogprobs
    token_ids: _struct_pb2.ListValue
    def __init__(self, index: _Optional[int] = ..., message: _Optional[_Union[ChatReplyMessage, _Mapping]] = ..., delta: _Optional[_Union[ChatReplyMessage, _Mapping]] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., logprobs: _Optional[_Union[ChatLogprobs, _Mapping]] = ..., token_ids: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ...) -> None: ...

class ChatReplyMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ChatToolCall]
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ChatToolCall, _Mapping]]] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class ChatLogprobs(_message.Message):
    __slots__ = ("content",)
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    content: _containers.RepeatedCompositeFieldContainer[ChatTokenLogprob]
    def __init__(self, content: _Optional[_Iterable[_Union[ChatTokenLogprob, _Mapping]]] = ...) -> None: ...

class ChatTokenLogprob(_message.Message):
    __slots__ = ("token", "logprob", "bytes", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: str
    logprob: float
    bytes: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[ChatTopLogprob]
    def __init__(self, token: _Optional[str] = ..., logprob: _Optional[float] = ..., bytes: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[_Union[ChatTopLogprob, _Mapping]]] = ...) -> None: ...

class ChatTopLogprob(_message.Message):
    __slots__ = ("token", "logprob", "bytes")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    token: str
    logprob: float
    bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token: _Optional[str] = ..., logprob: _Optional[float] = ..., bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "json_schema")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    type: str
    json_schema: JsonSchema
    def __init__(self, type: _Optional[str] = ..., json_schema: _Optional[_Union[JsonSchema, _Mapping]] = ...) -> None: ...

class JsonSchema(_message.Message):
    __slots__ = ("name", "description", "schema", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    schema: _struct_pb2.Struct
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., schema: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., strict: _Optional[bool] = ...) -> None: ...

class CreateCompletionResponse(_message.Message):
    __slots__ = ("id", "object", "created", "model", "choices", "usage", "system_fingerprint", "error", "metrics")
    ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    id: str
    object: str
    created: int
    model: str
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    usage: Usage
    system_fingerprint: str
    error: StreamError
    metrics: RequestMetrics
    def __init__(self, id: _Optional[str] = ..., object: _Optional[str] = ..., created: _Optional[int] = ..., model: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., system_fingerprint: _Optional[str] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ...) -> None: ...

class RequestMetrics(_message.Message):
    __slots__ = ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second", "total_time_ms")
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ITL_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    time_to_first_token_ms: float
    generation_time_ms: float
    queue_time_ms: float
    mean_itl_ms: float
    tokens_per_second: float
    total_time_ms: float
    def __init__(self, time_to_first_token_ms: _Optional[float] = ..., generation_time_ms: _Optional[float] = ..., queue_time_ms: _Optional[float] = ..., mean_itl_ms: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., total_time_ms: _Optional[float] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "text", "finish_reason", "logprobs", "stop_reason", "token_ids", "prompt_token_ids", "prompt_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    finish_reason: str
    logprobs: Logprobs
    stop_reason: _struct_pb2.Value
    token_ids: _struct_pb2.ListValue
    prompt_token_ids: _struct_pb2.ListValue
    prompt_logprobs: _struct_pb2.ListValue
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., stop_reason: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., token_ids: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    token_logprobs: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Value]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Value]
    text_offset: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[str]] = ..., token_logprobs: _Optional[_Iterable[_Union[_struct_pb2.Value, _Mapping]]] = ..., top_logprobs: _Optional[_Iterable[_Union[_struct_pb2.Value, _Mapping]]] = ..., text_offset: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "completion_tokens_details", "prompt_tokens_details")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails
    prompt_tokens_details: PromptTokensDetails
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., completion_tokens_details: _Optional[_Union[CompletionTokensDetails, _Mapping]] = ..., prompt_tokens_details: _Optional[_Union[PromptTokensDetails, _Mapping]] = ...) -> None: ...

class CompletionTokensDetails(_message.Message):
    __slots__ = ("accepted_prediction_tokens", "audio_tokens", "reasoning_tokens", "rejected_prediction_tokens")
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    accepted_prediction_tokens: int
    audio_tokens: int
    reasoning_tokens: int
    rejected_prediction_tokens: int
    def __init__(self, accepted_prediction_tokens: _Optional[int] = ..., audio_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class PromptTokensDetails(_message.Message):
    __slots__ = ("audio_tokens", "cached_tokens")
    AUDIO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    audio_tokens: int
    cached_tokens: int
    def __init__(self, audio_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("status_code", "content")
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    status_code: int
    content: StreamErrorContent
    def __init__(self, status_code: _Optional[int] = ..., content: _Optional[_Union[StreamErrorContent, _Mapping]] = ...) -> None: ...

class StreamErrorContent(_message.Message):
    __slots__ = ("error", "timestamp")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    error: str
    timestamp: str
    def __init__(self, error: _Optional[str] = ..., timestamp: _Optional[str] = ...) -> None: ...

class CreateBatchCompletionRequest(_message.Message):
    __slots__ = ("output_data_path", "input_data_path", "content", "model_config", "labels", "max_runtime_sec", "priority", "data_parallelism", "tool_config", "cpus", "gpus", "memory", "gpu_type", "storage", "nodes_per_worker")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OUTPUT_DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    INPUT_DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNTIME_SEC_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    TOOL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    NODES_PER_WORKER_FIELD_NUMBER: _ClassVar[int]
    output_data_path: str
    input_data_path: str
    content: _struct_pb2.Value
    model_config: _struct_pb2.Struct
    labels: _containers.ScalarMap[str, str]
    max_runtime_sec: int
    priority: str
    data_parallelism: int
    tool_config: _struct_pb2.Value
    cpus: _struct_pb2.Value
    gpus: _struct_pb2.Value
    memory: _struct_pb2.Value
    gpu_type: _struct_pb2.Value
    storage: _struct_pb2.Value
    nodes_per_worker: _struct_pb2.Value
    def __init__(self, output_data_path: _Optional[str] = ..., input_data_path: _Optional[str] = ..., content: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., model_config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., max_runtime_sec: _Optional[int] = ..., priority: _Optional[str] = ..., data_parallelism: _Optional[int] = ..., tool_config: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., cpus: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., gpus: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., memory: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., gpu_type: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., storage: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., nodes_per_worker: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...

class WatchBatchCompletionResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: BatchCompletionJob
    def __init__(self, job: _Optional[_Union[BatchCompletionJob, _Mapping]] = ...) -> None: ...

class BatchCompletionJob(_message.Message):
    __slots__ = ("job_id", "status", "input_data_path", "output_data_path", "model_config", "priority", "created_at", "expires_at", "completed_at", "metadata", "request_counts", "error")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    INPUT_DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REQUEST_COUNTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    status: str
    input_data_path: str
    output_data_path: str
    model_config: _struct_pb2.Struct
    priority: str
    created_at: str
    expires_at: str
    completed_at: str
    metadata: _containers.ScalarMap[str, str]
    request_counts: BatchRequestCounts
    error: str
    def __init__(self, job_id: _Optional[str] = ..., status: _Optional[str] = ..., input_data_path: _Optional[str] = ..., output_data_path: _Optional[str] = ..., model_config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., priority: _Optional[str] = ..., created_at: _Optional[str] = ..., expires_at: _Optional[str] = ..., completed_at: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., request_counts: _Optional[_Union[BatchRequestCounts, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class BatchRequestCounts(_message.Message):
    __slots__ = ("total", "completed", "failed")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    total: int
    completed: int
    failed: int
    def __init__(self, total: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class GetBatchCompletionRequest(_message.Message):
    __slots__ = ("batch_completion_id",)
    BATCH_COMPLETION_ID_FIELD_NUMBER: _ClassVar[int]
    batch_completion_id: str
    def __init__(self, batch_completion_id: _Optional[str] = ...) -> None: ...

class GetBatchCompletionResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: BatchCompletionJob
    def __init__(self, job: _Optional[_Union[BatchCompletionJob, _Mapping]] = ...) -> None: ...

class ListBatchCompletionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBatchCompletionsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[BatchCompletionJob]
    def __init__(self, jobs: _Optional[_Iterable[_Union[BatchCompletionJob, _Mapping]]] = ...) -> None: ...

class UpdateBatchCompletionRequest(_message.Message):
    __slots__ = ("batch_completion_id", "job_id", "priority")
    BATCH_COMPLETION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    batch_completion_id: str
    job_id: str
    priority: str
    def __init__(self, batch_completion_id: _Optional[str] = ..., job_id: _Optional[str] = ..., priority: _Optional[str] = ...) -> None: ...

class UpdateBatchCompletionResponse(_message.Message):
    __slots__ = ("job_id", "status", "priority", "success")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    status: str
    priority: str
    success: bool
    def __init__(self, job_id: _Optional[str] = ..., status: _Optional[str] = ..., priority: _Optional[str] = ..., success: _Optional[bool] = ...) -> None: ...

class CancelBatchCompletionRequest(_message.Message):
    __slots__ = ("batch_completion_id",)
    BATCH_COMPLETION_ID_FIELD_NUMBER: _ClassVar[int]
    batch_completion_id: str
    def __init__(self, batch_completion_id: _Optional[str] = ...) -> None: ...

class CancelBatchCompletionResponse(_message.Message):
    __slots__ = ("success",)
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    success: bool
    def __init__(self, success: _Optional[bool] = ...) -> None: ...

class WatchBatchCompletionRequest(_message.Message):
    __slots__ = ("batch_completion_id",)
    BATCH_COMPLETION_ID_FIELD_NUMBER: _ClassVar[int]
    batch_completion_id: str
    def __init__(self, batch_completion_id: _Optional[str] = ...) -> None: ...
