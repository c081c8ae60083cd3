/* A minimal writer of parity engine dumps (docs/dumps.md): plain C99, no dependencies.
 *
 * Copy dump_write() into an engine: gather the activations it has at capture points (float32,
 * row-major [batch, seq, width]) and the token ids it ran, and call it once. A safetensors file
 * is an 8-byte little-endian header length, a JSON header, then the raw little-endian bytes.
 *
 * An engine that decodes (parity check --decode N) calls dump_write_decode() instead, with the N tokens it was
 * fed one at a time after the prompt, and each point's steps stacked as one tensor "decode.<point>" of shape
 * [1, N, width] (step k at row k - 1).
 *
 * main() is a small command line around it, which parity's tests drive:
 *
 *   cc -std=c99 -O2 -o dump_writer docs/dump_writer.c
 *   ./dump_writer dump.safetensors 20,96,172 embed=embed.f32:1x3x64 logits=logits.f32:1x3x256
 *   ./dump_writer dump.safetensors 20,96,172 --decode 7,9 logits=l.f32:1x3x256 decode.logits=d.f32:1x2x256
 *
 * each .f32 file holding one point's raw float32 values (native byte order, row-major).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *name;            /* a capture point: "embed", "layers.0.out", "logits", ... */
    const float *data;           /* batch * seq * width values, row-major */
    int64_t batch, seq, width;
} dump_tensor;

typedef struct {
    char *s;
    size_t len, cap;
} text;

static int append(text *t, const char *s) {
    size_t n = strlen(s);
    if (t->len + n + 1 > t->cap) {
        size_t cap = 2 * (t->len + n + 1);
        char *grown = realloc(t->s, cap);
        if (!grown) return -1;
        t->s = grown;
        t->cap = cap;
    }
    memcpy(t->s + t->len, s, n + 1);
    t->len += n;
    return 0;
}

/* Names go into the JSON header unescaped: allow what capture-point names use. */
static int plain_name(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              *s == '.' || *s == '_' || *s == '-'))
            return 0;
    return 1;
}

static int write_f32_le(FILE *f, const float *x, size_t n) {
    unsigned char chunk[4096];
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], sizeof u);
        for (int j = 0; j < 4; j++) chunk[k++] = (unsigned char)(u >> (8 * j));
        if (k == sizeof chunk) {
            if (fwrite(chunk, 1, k, f) != k) return -1;
            k = 0;
        }
    }
    return (k && fwrite(chunk, 1, k, f) != k) ? -1 : 0;
}

static int append_ids(text *h, const int64_t *ids, size_t n) {
    char item[32];
    int failed = append(h, "\"[");
    for (size_t i = 0; i < n && !failed; i++) {
        snprintf(item, sizeof item, "%s%lld", i ? "," : "", (long long)ids[i]);
        failed = append(h, item);
    }
    return failed || append(h, "]\"");
}

/* Writes n tensors, the n_ids token ids of the prompt and the n_tokens tokens fed one decode step at a time
 * after it (none: tokens NULL, n_tokens 0) to path. Returns 0, or -1 (with a message on stderr). */
int dump_write_decode(const char *path, const int64_t *ids, size_t n_ids, const int64_t *tokens, size_t n_tokens,
                      const dump_tensor *t, size_t n) {
    text h = {0};
    char item[256];
    uint64_t offset = 0;
    int failed = append(&h, "{\"__metadata__\":{\"input_ids\":") || append_ids(&h, ids, n_ids);
    if (n_tokens) {
        snprintf(item, sizeof item, ",\"steps\":\"%zu\",\"decode_tokens\":", n_tokens);
        failed = failed || append(&h, item) || append_ids(&h, tokens, n_tokens);
    }
    failed = failed || append(&h, "}");
    for (size_t i = 0; i < n && !failed; i++) {
        if (!plain_name(t[i].name)) {
            fprintf(stderr, "dump_write: %s: use capture-point names (letters, digits, '.', '_')\n", t[i].name);
            free(h.s);
            return -1;
        }
        uint64_t bytes = 4u * (uint64_t)t[i].batch * (uint64_t)t[i].seq * (uint64_t)t[i].width;
        snprintf(item, sizeof item, ",\"%s\":{\"dtype\":\"F32\",\"shape\":[%lld,%lld,%lld],\"data_offsets\":[%llu,%llu]}",
                 t[i].name, (long long)t[i].batch, (long long)t[i].seq, (long long)t[i].width,
                 (unsigned long long)offset, (unsigned long long)(offset + bytes));
        failed = append(&h, item);
        offset += bytes;
    }
    failed = failed || append(&h, "}");
    while (!failed && h.len % 8) failed = append(&h, " "); /* tensor data starts 8-byte aligned */
    if (failed) {
        fprintf(stderr, "dump_write: out of memory\n");
        free(h.s);
        return -1;
    }

    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        free(h.s);
        return -1;
    }
    unsigned char length[8];
    for (int j = 0; j < 8; j++) length[j] = (unsigned char)((uint64_t)h.len >> (8 * j));
    int bad = fwrite(length, 1, 8, f) != 8 || fwrite(h.s, 1, h.len, f) != h.len;
    for (size_t i = 0; i < n && !bad; i++)
        bad = write_f32_le(f, t[i].data, (size_t)(t[i].batch * t[i].seq * t[i].width)) != 0;
    bad = fclose(f) != 0 || bad;
    free(h.s);
    if (bad) perror(path);
    return bad ? -1 : 0;
}

/* Writes n tensors and the n_ids token ids the engine ran (a prompt, no decode steps). */
int dump_write(const char *path, const int64_t *ids, size_t n_ids, const dump_tensor *t, size_t n) {
    return dump_write_decode(path, ids, n_ids, NULL, 0, t, n);
}

/* ---------------------------------------------------------------- the command line */

static float *read_floats(const char *file, size_t count) {
    FILE *f = fopen(file, "rb");
    float *x = malloc(count * sizeof *x + 1);
    if (!f || !x) {
        if (f) fclose(f);
        free(x);
        return NULL;
    }
    size_t got = fread(x, sizeof *x, count, f);
    int extra = fgetc(f) != EOF;
    fclose(f);
    if (got != count || extra) {
        free(x);
        return NULL;
    }
    return x;
}

/* "1,2,3" -> a malloc'd array of its *count integers. */
static int64_t *parse_ids(const char *list, size_t *count) {
    *count = 1;
    for (const char *c = list; *c; c++) *count += *c == ',';
    int64_t *ids = malloc(*count * sizeof *ids);
    char *cursor = (char *)list;
    for (size_t i = 0; ids && i < *count; i++) ids[i] = strtoll(cursor, &cursor, 10), cursor += *cursor == ',';
    return ids;
}

int main(int argc, char **argv) {
    int decoding = argc > 4 && strcmp(argv[3], "--decode") == 0, first = decoding ? 5 : 3;
    if (argc < first + 1) {
        fprintf(stderr, "usage: %s OUT.safetensors ID,ID,... [--decode T,T,...] NAME=FILE.f32:BxSxW ...\n", argv[0]);
        return 2;
    }
    size_t n_ids, n_tokens = 0, n = (size_t)(argc - first);
    int64_t *ids = parse_ids(argv[2], &n_ids), *tokens = decoding ? parse_ids(argv[4], &n_tokens) : NULL;
    dump_tensor *t = calloc(n, sizeof *t);
    if (!ids || !t || (decoding && !tokens)) return 1;

    int status = 0;
    for (size_t i = 0; i < n && !status; i++) {
        char *spec = argv[first + i], *eq = strchr(spec, '='), *colon = strrchr(spec, ':');
        long long b, s, w;
        if (!eq || !colon || colon < eq || sscanf(colon + 1, "%lldx%lldx%lld", &b, &s, &w) != 3) {
            fprintf(stderr, "%s: expected NAME=FILE.f32:BxSxW\n", spec);
            status = 2;
            break;
        }
        *eq = *colon = '\0';
        t[i] = (dump_tensor){spec, read_floats(eq + 1, (size_t)(b * s * w)), b, s, w};
        if (!t[i].data) {
            fprintf(stderr, "%s: cannot read %lld float32 values\n", eq + 1, b * s * w);
            status = 1;
        }
    }
    if (!status && dump_write_decode(argv[1], ids, n_ids, tokens, n_tokens, t, n) != 0) status = 1;
    for (size_t i = 0; i < n; i++) free((void *)t[i].data);
    free(t);
    free(ids);
    free(tokens);
    return status;
}
