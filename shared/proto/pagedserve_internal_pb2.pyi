import pagedserve_api_pb2 as _pagedserve_api_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "cache_salt", "resumed", "lora", "pooling", "priority", "arrival_time", "trace_context", "images")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _pagedserve_api_pb2.SamplingParameters
    cache_salt: str
    resumed: _containers.RepeatedCompositeFieldContainer[ResumedSequence]
    lora: LoRAAdapter
    pooling: _pagedserve_api_pb2.PoolingParameters
    priority: int
    arrival_time: float
    trace_context: _containers.ScalarMap[str, str]
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_pagedserve_api_pb2.SamplingParameters, _Mapping]] = ..., cache_salt: _Optional[str] = ..., resumed: _Optional[_Iterable[_Union[ResumedSequence, _Mapping]]] = ..., lora: _Optional[_Union[LoRAAdapter, _Mapping]] = ..., pooling: _Optional[_Union[_pagedserve_api_pb2.PoolingParameters, _Mapping]] = ..., priority: _Optional[int] = ..., arrival_time: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ...) -> None: ...

class ImageInput(_message.Message):
    __slots__ = ("hash", "offset", "length", "pixel_values", "shape", "dtype", "layout")
    HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    offset: int
    length: int
    pixel_values: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    layout: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hash: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., pixel_values: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., layout: _Optional[_Iterable[int]] = ...) -> None: ...

class PoolerInfo(_message.Message):
    __slots__ = ("pooling_type", "normalize", "hidden_size", "matryoshka", "matryoshka_dimensions", "max_seq_length", "lowercase", "labels", "activation")
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LOWERCASE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    pooling_type: str
    normalize: bool
    hidden_size: int
    matryoshka: bool
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    max_seq_length: int
    lowercase: bool
    labels: _containers.RepeatedScalarFieldContainer[str]
    activation: str
    def __init__(self, pooling_type: _Optional[str] = ..., normalize: _Optional[bool] = ..., hidden_size: _Optional[int] = ..., matryoshka: _Optional[bool] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., max_seq_length: _Optional[int] = ..., lowercase: _Optional[bool] = ..., labels: _Optional[_Iterable[str]] = ..., activation: _Optional[str] = ...) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ResumedSequence(_message.Message):
    __slots__ = ("seq_index", "output_token_ids")
    SEQ_INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_index: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_index: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("submit", "abort", "stop_sequence")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    submit: SessionSubmit
    abort: int
    stop_sequence: SessionStopSequence
    def __init__(self, submit: _Optional[_Union[SessionSubmit, _Mapping]] = ..., abort: _Optional[int] = ..., stop_sequence: _Optional[_Union[SessionStopSequence, _Mapping]] = ...) -> None: ...

class SessionStopSequence(_message.Message):
    __slots__ = ("key", "seq_index", "stop_string")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SEQ_INDEX_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    key: int
    seq_index: int
    stop_string: str
    def __init__(self, key: _Optional[int] = ..., seq_index: _Optional[int] = ..., stop_string: _Optional[str] = ...) -> None: ...

class SessionSubmit(_message.Message):
    __slots__ = ("key", "request")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    key: int
    request: EngineRequest
    def __init__(self, key: _Optional[int] = ..., request: _Optional[_Union[EngineRequest, _Mapping]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("key", "code", "message")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    key: int
    code: int
    message: str
    def __init__(self, key: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionEvents(_message.Message):
    __slots__ = ("tokens", "detailed", "detailed_positions", "finished", "errors", "cache_snapshot", "cache_added", "cache_removed")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DETAILED_FIELD_NUMBER: _ClassVar[int]
    DETAILED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    CACHE_ADDED_FIELD_NUMBER: _ClassVar[int]
    CACHE_REMOVED_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenOutputs
    detailed: _containers.RepeatedCompositeFieldContainer[EngineOutput]
    detailed_positions: _containers.RepeatedScalarFieldContainer[int]
    finished: _containers.RepeatedScalarFieldContainer[int]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    cache_snapshot: bool
    cache_added: _containers.RepeatedScalarFieldContainer[int]
    cache_removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Union[TokenOutputs, _Mapping]] = ..., detailed: _Optional[_Iterable[_Union[EngineOutput, _Mapping]]] = ..., detailed_positions: _Optional[_Iterable[int]] = ..., finished: _Optional[_Iterable[int]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ..., cache_snapshot: _Optional[bool] = ..., cache_added: _Optional[_Iterable[int]] = ..., cache_removed: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenOutputs(_message.Message):
    __slots__ = ("keys", "seq_indexes", "num_tokens", "token_ids")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SEQ_INDEXES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    seq_indexes: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[int]] = ..., seq_indexes: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EngineOutput(_message.Message):
    __slots__ = ("key", "seq_index", "new_token_ids", "new_logprobs", "prompt_logprobs", "finish_reason", "stop_token_id", "stop_string", "num_cached_tokens", "embedding")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SEQ_INDEX_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    key: int
    seq_index: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    finish_reason: str
    stop_token_id: int
    stop_string: str
    num_cached_tokens: int
    embedding: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, key: _Optional[int] = ..., seq_index: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., embedding: _Optional[_Iterable[float]] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model", "max_model_len", "vocab_size", "eos_token_ids", "num_kv_blocks", "block_size", "max_logprobs", "protocol_version", "max_num_seqs", "max_loras", "pooler", "priority_scheduling", "image_token_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    POOLER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_kv_blocks: int
    block_size: int
    max_logprobs: int
    protocol_version: int
    max_num_seqs: int
    max_loras: int
    pooler: PoolerInfo
    priority_scheduling: bool
    image_token_id: int
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_logprobs: _Optional[int] = ..., protocol_version: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_loras: _Optional[int] = ..., pooler: _Optional[_Union[PoolerInfo, _Mapping]] = ..., priority_scheduling: _Optional[bool] = ..., image_token_id: _Optional[int] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("values", "histograms", "labels")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class HistogramsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Histogram
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Histogram, _Mapping]] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAMS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    histograms: _containers.MessageMap[str, Histogram]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, values: _Optional[_Mapping[str, float]] = ..., histograms: _Optional[_Mapping[str, Histogram]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Histogram(_message.Message):
    __slots__ = ("bounds", "cumulative_counts", "count", "sum")
    BOUNDS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    bounds: _containers.RepeatedScalarFieldContainer[float]
    cumulative_counts: _containers.RepeatedScalarFieldContainer[int]
    count: int
    sum: float
    def __init__(self, bounds: _Optional[_Iterable[float]] = ..., cumulative_counts: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., sum: _Optional[float] = ...) -> None: ...

class BlockRead(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockData(_message.Message):
    __slots__ = ("pool", "first", "count", "data")
    POOL_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    pool: int
    first: int
    count: int
    data: bytes
    def __init__(self, pool: _Optional[int] = ..., first: _Optional[int] = ..., count: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVPull(_message.Message):
    __slots__ = ("source", "moves")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    source: str
    moves: _containers.RepeatedCompositeFieldContainer[BlockMove]
    def __init__(self, source: _Optional[str] = ..., moves: _Optional[_Iterable[_Union[BlockMove, _Mapping]]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model", "num_kv_blocks", "block_size", "max_model_len", "vocab_size", "eos_token_ids", "device", "dtype", "num_cpu_blocks", "protocol_version", "num_speculative_tokens", "tensor_parallel_rank", "tensor_parallel_size", "max_loras", "max_lora_rank", "pooler", "kv_window", "num_cpu_offload_blocks", "image_token_id", "kv_cache_dtype", "kv_scales_measured", "whole_images")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    POOLER_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_OFFLOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_MEASURED_FIELD_NUMBER: _ClassVar[int]
    WHOLE_IMAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    device: str
    dtype: str
    num_cpu_blocks: int
    protocol_version: int
    num_speculative_tokens: int
    tensor_parallel_rank: int
    tensor_parallel_size: int
    max_loras: int
    max_lora_rank: int
    pooler: PoolerInfo
    kv_window: int
    num_cpu_offload_blocks: int
    image_token_id: int
    kv_cache_dtype: str
    kv_scales_measured: bool
    whole_images: bool
    def __init__(self, model: _Optional[str] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., num_cpu_blocks: _Optional[int] = ..., protocol_version: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., tensor_parallel_rank: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., pooler: _Optional[_Union[PoolerInfo, _Mapping]] = ..., kv_window: _Optional[int] = ..., num_cpu_offload_blocks: _Optional[int] = ..., image_token_id: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., kv_scales_measured: _Optional[bool] = ..., whole_images: _Optional[bool] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("request_id", "seq_id", "index", "prompt_token_ids", "output_token_ids", "sampling_params", "block_table", "num_computed_tokens", "num_scheduled_tokens", "num_siblings", "lora", "pooling", "trace_context", "images")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SIBLINGS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq_id: int
    index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _pagedserve_api_pb2.SamplingParameters
    block_table: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_siblings: int
    lora: LoRAAdapter
    pooling: _pagedserve_api_pb2.PoolingParameters
    trace_context: _containers.ScalarMap[str, str]
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    def __init__(self, request_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_pagedserve_api_pb2.SamplingParameters, _Mapping]] = ..., block_table: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., num_siblings: _Optional[int] = ..., lora: _Optional[_Union[LoRAAdapter, _Mapping]] = ..., pooling: _Optional[_Union[_pagedserve_api_pb2.PoolingParameters, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RunningDeltas(_message.Message):
    __slots__ = ("seq_ids", "num_computed_tokens", "num_scheduled_tokens", "append_last_sample", "num_new_tokens", "new_token_ids", "num_new_blocks", "new_block_ids", "new_block_tables", "num_draft_tokens", "draft_token_ids")
    class NewBlockTablesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: BlockIds
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[BlockIds, _Mapping]] = ...) -> None: ...
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPEND_LAST_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    append_last_sample: _containers.RepeatedScalarFieldContainer[bool]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    new_block_tables: _containers.MessageMap[int, BlockIds]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., append_last_sample: _Optional[_Iterable[bool]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., new_block_tables: _Optional[_Mapping[int, BlockIds]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Fork(_message.Message):
    __slots__ = ("parent_seq_id", "child_seq_id", "child_index")
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_INDEX_FIELD_NUMBER: _ClassVar[int]
    parent_seq_id: int
    child_seq_id: int
    child_index: int
    def __init__(self, parent_seq_id: _Optional[int] = ..., child_seq_id: _Optional[int] = ..., child_index: _Optional[int] = ...) -> None: ...

class BlockMove(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new", "running", "finished_seq_ids", "forks", "swap_out", "swap_in", "copies", "pulls")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new: _containers.RepeatedCompositeFieldContainer[NewSequence]
    running: RunningDeltas
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    forks: _containers.RepeatedCompositeFieldContainer[Fork]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockMove]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockMove]
    copies: _containers.RepeatedCompositeFieldContainer[BlockMove]
    pulls: _containers.RepeatedCompositeFieldContainer[KVPull]
    def __init__(self, step_id: _Optional[int] = ..., new: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., running: _Optional[_Union[RunningDeltas, _Mapping]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., forks: _Optional[_Iterable[_Union[Fork, _Mapping]]] = ..., swap_out: _Optional[_Iterable[_Union[BlockMove, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockMove, _Mapping]]] = ..., copies: _Optional[_Iterable[_Union[BlockMove, _Mapping]]] = ..., pulls: _Optional[_Iterable[_Union[KVPull, _Mapping]]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("token_id", "logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprobs: PositionLogprobs
    def __init__(self, token_id: _Optional[int] = ..., logprobs: _Optional[_Union[PositionLogprobs, _Mapping]] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprobs", "prompt_logprobs", "prompt_logprobs_start", "siblings", "accepted_token_ids", "accepted_logprobs", "draft_token_ids", "error", "embedding")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_START_FIELD_NUMBER: _ClassVar[int]
    SIBLINGS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_id: int
    logprobs: PositionLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    prompt_logprobs_start: int
    siblings: _containers.RepeatedCompositeFieldContainer[Sample]
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    error: str
    embedding: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprobs: _Optional[_Union[PositionLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., prompt_logprobs_start: _Optional[int] = ..., siblings: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., accepted_token_ids: _Optional[_Iterable[int]] = ..., accepted_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ..., embedding: _Optional[_Iterable[float]] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("seq_ids", "token_ids", "detailed", "detailed_positions", "num_accepted", "accepted_token_ids", "num_drafts", "draft_token_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DETAILED_FIELD_NUMBER: _ClassVar[int]
    DETAILED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    detailed: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    detailed_positions: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: _containers.RepeatedScalarFieldContainer[int]
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_drafts: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., detailed: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ..., detailed_positions: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[_Iterable[int]] = ..., accepted_token_ids: _Optional[_Iterable[int]] = ..., num_drafts: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "outputs", "forward_time_s", "sample_time_s", "error", "propose_time_s", "failed_block_ids", "recompute_seq_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    FAILED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    outputs: StepOutputs
    forward_time_s: float
    sample_time_s: float
    error: str
    propose_time_s: float
    failed_block_ids: _containers.RepeatedScalarFieldContainer[int]
    recompute_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., outputs: _Optional[_Union[StepOutputs, _Mapping]] = ..., forward_time_s: _Optional[float] = ..., sample_time_s: _Optional[float] = ..., error: _Optional[str] = ..., propose_time_s: _Optional[float] = ..., failed_block_ids: _Optional[_Iterable[int]] = ..., recompute_seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...
