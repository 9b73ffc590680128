/*
 * samplerd_plugin.h — the C ABI of samplerd sampler-stage plugins, version 1.
 *
 * A plugin is a shared library (.so) that exports ONE symbol:
 *
 *     const sd_plugin *samplerd_plugin_entry_v1(void);
 *
 * The major ABI version is part of the symbol name, so a library built for
 * another major version is not even looked at. The returned descriptor is
 * checked field by field before any stage is registered (abi_major,
 * abi_minor <= host minor, struct sizes, the candidate-layout canary).
 *
 * ---------------------------------------------------------------------------
 * Lifetimes and ownership (the rules every pointer below follows)
 * ---------------------------------------------------------------------------
 *  - The host loads a library once at start-up and NEVER unloads it, so every
 *    static the library returns (descriptor, vtables, names, param specs) must
 *    live for the life of the process.
 *  - Memory is freed by whoever allocated it. A plugin allocates its configs
 *    and states and frees them in config_free/state_free; the host allocates
 *    the token buffer, the error buffer, the RNG and the vocabulary and never
 *    lets the plugin free them.
 *  - Pointers handed to a callback are valid only during that call unless
 *    stated otherwise. A plugin that needs a parameter's string or map later
 *    copies it in config_new.
 *
 * Threading
 *  - A config is built once (config_new), then shared read-only by many
 *    threads at once: every callback that takes `const void *config` must be
 *    safe to call concurrently with the same config.
 *  - A state belongs to one sequence and is never used by two threads at
 *    once; the host serialises all calls that take the same state.
 *
 * Errors
 *  - Functions returning int return SD_OK (0) on success. On failure they
 *    return SD_ERR and write a NUL-terminated, human-readable message into
 *    err->message (at most SD_ERROR_MESSAGE_LEN bytes including the NUL).
 *    The host names the stage in front of the message.
 *  - accept and apply may return SD_ERR_INPUT instead, the same way, when
 *    the failure is the request's doing rather than the stage's: a grammar
 *    that outgrows its parser's limits partway through a row, a token the
 *    grammar does not allow. The host then answers the client
 *    INVALID_ARGUMENT (SAMPLERD_STAGE_REFUSED) instead of an internal
 *    error. Any host treats a non-zero return as failure, so a plugin may
 *    return it to a host that predates it (which reports an internal error).
 *  - A plugin must never let a C++ exception or a Rust panic unwind into the
 *    host: the Rust SDK catches panics and turns them into SD_ERR; after a
 *    panic the state is poisoned and every later call on it fails.
 *
 * Compatibility
 *  - Every struct begins with `struct_size`. Fields are only ever appended,
 *    and a reader never touches a field beyond struct_size, so a plugin built
 *    against an older minor version keeps working with a newer host.
 */
#ifndef SAMPLERD_PLUGIN_H
#define SAMPLERD_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SD_ABI_MAJOR 1
#define SD_ABI_MINOR 3 /* 1: SD_STAGE_OUTPUT_ONLY; 2: SD_STAGE_SPARSE_LOWERS_ONLY; 3: sd_rng.keyed_u64 */

#define SD_OK 0
#define SD_ERR 1
#define SD_ERR_INPUT 2 /* failed because of the request's input (see Errors) */

#define SD_ERROR_MESSAGE_LEN 512

/* The name of the symbol a plugin exports, as a string, for dlsym. */
#define SD_PLUGIN_ENTRY_SYMBOL "samplerd_plugin_entry_v1"

/* One candidate token: its id and its current logit. A removed token is
 * either absent from the candidate list or has logit -INFINITY. 8 bytes. */
typedef struct sd_candidate {
    uint32_t id;
    float logit;
} sd_candidate;

/* Which of the two views of the logits is current. */
#define SD_VIEW_DENSE 0      /* dense[id] is the logit of token id, all n_vocab of them */
#define SD_VIEW_CANDIDATES 1 /* cand[0..size) are the surviving candidates */

/*
 * The logits of one step, in one of two views. Owned by the host; valid for
 * the duration of one apply call.
 *
 * Dense view (view == SD_VIEW_DENSE): `dense` holds n_vocab logits indexed
 * by token id. Stages that touch a few ids (penalties, logit bias) edit them
 * in O(touched). A truncating stage may switch the buffer to the candidate
 * view by writing its survivors into cand[0..k), setting size = k, view =
 * SD_VIEW_CANDIDATES and `sorted` as appropriate. `dense` stays readable.
 *
 * Candidate view: cand[0..size) are the surviving tokens, in an order that
 * later stages and the final draw respect. A stage may reorder them, lower
 * `size` (never raise it), or set a logit to -INFINITY; it must not invent
 * ids that were not there.
 *
 * `cand` always has room for n_vocab entries.
 * `selected` is -1 until a selecting stage writes the chosen token id.
 */
typedef struct sd_tokens {
    uint32_t struct_size;
    uint32_t n_vocab;
    float *dense;
    sd_candidate *cand;
    size_t size;
    uint32_t view;   /* SD_VIEW_DENSE or SD_VIEW_CANDIDATES */
    uint32_t sorted; /* 1: cand[0..size) sorted by logit, descending */
    int64_t selected;
} sd_tokens;

/*
 * Randomness, owned by the host. The host seeds one counter-based stream per
 * (seed, step), so a seed means the same thing for every plugin. Valid during
 * one apply call. Uniform doubles in [0, 1) are (next_u64 >> 11) * 2^-53.
 *
 * keyed_u64 (since ABI 1.3; read it only when struct_size covers it, and
 * it may still be NULL): a draw fixed by (seed, step, key) alone — not by
 * how many draws came before, nor by which other keys were asked for. A
 * stage that draws one value per token id (the `coupled` draw: a Gumbel
 * race) uses it so the token a seed picks does not depend on the
 * candidate list's order or length. The host's keyed draws are a stream
 * of their own, disjoint from next_u64's.
 */
typedef struct sd_rng {
    uint32_t struct_size;
    void *ctx;
    uint64_t (*next_u64)(void *ctx);
    uint64_t (*keyed_u64)(void *ctx, uint64_t key);
} sd_rng;

/* Token attribute bits in sd_vocab.token_attr. */
#define SD_TOKEN_NORMAL 0u
#define SD_TOKEN_CONTROL (1u << 0)  /* special / control token, e.g. <|im_end|> */
#define SD_TOKEN_EOG (1u << 1)      /* ends generation (eos, eot, eom) */
#define SD_TOKEN_BYTE (1u << 2)     /* a raw-byte fallback token */
#define SD_TOKEN_UNUSED (1u << 3)

/*
 * Read-only view of the model's vocabulary, owned by the host, valid from
 * config_new until config_free of the config it was handed to. When no model
 * is loaded, config_new receives NULL. Token i's bytes are
 * token_bytes[i][0..token_len[i]) (not NUL-terminated).
 */
typedef struct sd_vocab {
    uint32_t struct_size;
    uint32_t n_vocab;
    const uint8_t *const *token_bytes;
    const uint32_t *token_len;
    const uint32_t *token_attr;
} sd_vocab;

/* Parameter value kinds. */
#define SD_PARAM_NUMBER 0    /* `number` holds the value */
#define SD_PARAM_STRING 1    /* `string` is a NUL-terminated UTF-8 string */
#define SD_PARAM_TOKEN_MAP 2 /* `map[0..map_len)` pairs of token id and value */
#define SD_PARAM_STRING_LIST 3 /* `strings[0..strings_len)` NUL-terminated UTF-8 */

typedef struct sd_token_value {
    uint32_t id;
    float value;
} sd_token_value;

/* One parameter value handed to config_new. Valid during that call only. */
typedef struct sd_param {
    uint32_t struct_size;
    uint32_t kind;
    const char *name;
    double number;
    const char *string;
    const sd_token_value *map;
    size_t map_len;
    const char *const *strings;
    size_t strings_len;
} sd_param;

/* Describes one parameter a stage accepts (static, for ListStages and
 * validation of names: a name not listed is refused by the host). */
typedef struct sd_param_spec {
    uint32_t struct_size;
    uint32_t kind;
    const char *name;
    const char *description;
    double default_number; /* used when kind == SD_PARAM_NUMBER */
} sd_param_spec;

typedef struct sd_error {
    char message[SD_ERROR_MESSAGE_LEN];
} sd_error;

/* Stage flags. */
#define SD_STAGE_SELECTS (1u << 0)  /* writes tokens->selected; may end a chain */
#define SD_STAGE_DENSE_OK (1u << 1) /* handles the dense view; else the host converts first */
#define SD_STAGE_NEEDS_VOCAB (1u << 2) /* config_new fails without a vocabulary */
/* accept sees only the tokens the sequence generates, never the history the
 * host replays into a fresh sequence (a prompt's tail, previous_tokens):
 * what a grammar needs, whose state starts where the output starts. Since
 * ABI 1.1. */
#define SD_STAGE_OUTPUT_ONLY (1u << 3)
/* apply only lowers logits or removes tokens, one token at a time: a
 * token's new logit (or its removal) depends only on its id, its own logit,
 * the config and the sequence's state -- never on another token's logit --
 * and is never above the logit it had; removal keeps the remaining
 * candidates in their order; nothing is drawn from the rng; the result for
 * a token is the same in either view. The host may then run the stage over
 * part of a row (the entries a client sent of a sparse row) and still know
 * that every token it did not send stays at or below the bound it had
 * (docs/SAMPLING.md, "Sparse rows"). Without the flag a stage is assumed to
 * need the whole row. Honoured from plugins built for ABI 1.2 or later. */
#define SD_STAGE_SPARSE_LOWERS_ONLY (1u << 4)

/*
 * One stage. Every function pointer is required (use a no-op where nothing is
 * to be done).
 *
 * config_new:  validate `params` (every name is one of `params_spec`, values
 *              already checked to be of the declared kind) and build an
 *              immutable config. Parameters not given take their defaults.
 * state_new:   per-sequence state (may be a dummy non-NULL pointer).
 * state_clone: deep copy of a state, for forking a sequence.
 * state_reset: back to the state state_new returns.
 * accept:      the sequence has emitted `token` (also called once per
 *              previous token, oldest first, to seed a fresh state).
 * apply:       transform `tokens` in place. `rng` is non-NULL always; only
 *              selecting stages should draw from it.
 */
typedef struct sd_stage {
    uint32_t struct_size;
    uint32_t flags;
    const char *name;
    const char *description;
    const sd_param_spec *params_spec;
    size_t n_params_spec;
    int (*config_new)(const sd_param *params, size_t n_params, const sd_vocab *vocab,
                      void **out_config, sd_error *err);
    void (*config_free)(void *config);
    int (*state_new)(const void *config, void **out_state, sd_error *err);
    int (*state_clone)(const void *config, const void *state, void **out_state, sd_error *err);
    void (*state_free)(const void *config, void *state);
    int (*state_reset)(const void *config, void *state, sd_error *err);
    int (*accept)(const void *config, void *state, uint32_t token, sd_error *err);
    int (*apply)(const void *config, void *state, sd_tokens *tokens, sd_rng *rng, sd_error *err);
} sd_stage;

/* What samplerd_plugin_entry_v1 returns: a static descriptor of the library. */
typedef struct sd_plugin {
    uint32_t struct_size;
    uint32_t abi_major;        /* SD_ABI_MAJOR */
    uint32_t abi_minor;        /* SD_ABI_MINOR the plugin was built against */
    uint32_t candidate_size;   /* sizeof(sd_candidate): layout canary */
    uint32_t tokens_size;      /* sizeof(sd_tokens) */
    uint32_t stage_size;       /* sizeof(sd_stage) */
    const char *library_name;  /* short name, e.g. "core" */
    const char *library_version;
    const sd_stage *const *stages;
    size_t n_stages;
} sd_plugin;

/* Fills the version and layout fields of a descriptor (for C plugins). */
#define SD_PLUGIN_HEADER                                                      \
    sizeof(sd_plugin), SD_ABI_MAJOR, SD_ABI_MINOR, sizeof(sd_candidate),      \
        sizeof(sd_tokens), sizeof(sd_stage)

typedef const sd_plugin *(*sd_plugin_entry_fn)(void);

#ifdef __cplusplus
}
#endif

#endif /* SAMPLERD_PLUGIN_H */
