/*
 * ban_tokens.c — a third-party samplerd stage written in C against
 * samplerd_plugin.h: removes (sets to -inf) a fixed list of token ids.
 *
 * Build:  cc -std=c11 -O2 -shared -fPIC -I ../sdk/include ban_tokens.c -o libban_tokens.so
 * Use:    drop libban_tokens.so into a plugin directory, then name the stage in a chain:
 *         {"name": "ban_tokens", "params": {"ids": {"text": "13,42"}}}
 *
 * It works on both views: in the dense view it touches only the banned ids
 * (O(#ids)); in the candidate view it masks matching candidates.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "samplerd_plugin.h"

typedef struct ban_config {
    size_t n;
    uint32_t *ids; /* sorted ascending */
} ban_config;

static void set_error(sd_error *err, const char *msg, const char *detail) {
    if (err) snprintf(err->message, SD_ERROR_MESSAGE_LEN, "%s%s", msg, detail ? detail : "");
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

static int ban_config_new(const sd_param *params, size_t n_params, const sd_vocab *vocab,
                          void **out_config, sd_error *err) {
    (void)vocab;
    const char *list = "";
    for (size_t i = 0; i < n_params; i++) {
        if (strcmp(params[i].name, "ids") == 0 && params[i].kind == SD_PARAM_STRING) list = params[i].string;
    }
    ban_config *cfg = calloc(1, sizeof *cfg);
    if (!cfg) { set_error(err, "out of memory", NULL); return SD_ERR; }
    size_t cap = 1 + strlen(list) / 2;
    cfg->ids = calloc(cap, sizeof *cfg->ids);
    if (!cfg->ids) { free(cfg); set_error(err, "out of memory", NULL); return SD_ERR; }
    const char *p = list;
    while (*p) {
        char *end;
        unsigned long v = strtoul(p, &end, 10);
        if (end == p || v > UINT32_MAX) {
            free(cfg->ids); free(cfg);
            set_error(err, "ids must be a comma-separated list of token ids, got: ", list);
            return SD_ERR;
        }
        cfg->ids[cfg->n++] = (uint32_t)v;
        p = end;
        while (*p == ',' || *p == ' ') p++;
    }
    qsort(cfg->ids, cfg->n, sizeof *cfg->ids, cmp_u32);
    *out_config = cfg;
    return SD_OK;
}

static void ban_config_free(void *config) {
    ban_config *cfg = config;
    if (cfg) { free(cfg->ids); free(cfg); }
}

/* Stateless: a static dummy state that is never freed. */
static char dummy_state;
static int ban_state_new(const void *c, void **out, sd_error *e) { (void)c; (void)e; *out = &dummy_state; return SD_OK; }
static int ban_state_clone(const void *c, const void *s, void **out, sd_error *e) { (void)c; (void)s; (void)e; *out = &dummy_state; return SD_OK; }
static void ban_state_free(const void *c, void *s) { (void)c; (void)s; }
static int ban_state_reset(const void *c, void *s, sd_error *e) { (void)c; (void)s; (void)e; return SD_OK; }
static int ban_accept(const void *c, void *s, uint32_t t, sd_error *e) { (void)c; (void)s; (void)t; (void)e; return SD_OK; }

static int ban_apply(const void *config, void *state, sd_tokens *tokens, sd_rng *rng, sd_error *err) {
    (void)state; (void)rng; (void)err;
    const ban_config *cfg = config;
    if (tokens->view == SD_VIEW_DENSE) {
        for (size_t i = 0; i < cfg->n; i++)
            if (cfg->ids[i] < tokens->n_vocab) tokens->dense[cfg->ids[i]] = -INFINITY;
    } else {
        for (size_t i = 0; i < tokens->size; i++)
            if (bsearch(&tokens->cand[i].id, cfg->ids, cfg->n, sizeof *cfg->ids, cmp_u32))
                tokens->cand[i].logit = -INFINITY;
    }
    return SD_OK;
}

static const sd_param_spec ban_params[] = {
    {sizeof(sd_param_spec), SD_PARAM_STRING, "ids", "comma-separated token ids to remove", 0.0},
};

static const sd_stage ban_stage = {
    sizeof(sd_stage),
    /* It only sets listed ids to -inf: sparse rows may use it. */
    SD_STAGE_DENSE_OK | SD_STAGE_SPARSE_LOWERS_ONLY,
    "ban_tokens",
    "removes a fixed list of token ids (example C plugin)",
    ban_params,
    sizeof ban_params / sizeof ban_params[0],
    ban_config_new,
    ban_config_free,
    ban_state_new,
    ban_state_clone,
    ban_state_free,
    ban_state_reset,
    ban_accept,
    ban_apply,
};

static const sd_stage *const stages[] = {&ban_stage};

static const sd_plugin plugin = {
#ifdef SD_TEST_WRONG_ABI
    /* Test fixture: pretend to be built for ABI 2.0. */
    sizeof(sd_plugin), 2, 0, sizeof(sd_candidate), sizeof(sd_tokens), sizeof(sd_stage),
#else
    SD_PLUGIN_HEADER,
#endif
    "ban_tokens_example",
    "1.0.0",
    stages,
    1,
};

const sd_plugin *samplerd_plugin_entry_v1(void) { return &plugin; }
