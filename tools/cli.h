/* cli.h — the `duet` subcommands and their shared argument helpers. */
#ifndef DUET_CLI_H
#define DUET_CLI_H

#include <stdbool.h>

#include "duet.h"

int cmd_run(int argc, char **argv);
int cmd_chat(int argc, char **argv);
int cmd_info(int argc, char **argv);
int cmd_devices(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_mkmodel(int argc, char **argv);
int cmd_quantize(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_profile(int argc, char **argv);

/* Parse a number, printing "duet: --flag: ..." and returning false when the
 * text is not a number or outside [min, max]. */
bool cli_int(const char *flag, const char *text, long min, long max, int *out);
bool cli_u64(const char *flag, const char *text, unsigned long long *out);
bool cli_float(const char *flag, const char *text, double min, double max, float *out);

/* Prints "duet: <what>: <last error>" (with a hint when useful) and returns 1. */
int cli_fail(const char *what, duet_status st);

/* Tokenizes `text` into a malloc'd array (*ids, NULL when there are none;
 * the caller frees it). Returns the id count, or -1 after printing why. */
int cli_tokenize(const duet_model *m, const char *text, bool add_special, bool parse_special, int32_t **ids);

/* Path of the default model (SmolLM2-135M-Instruct, Q4_1) in duet's cache;
 * NULL after saying how to fetch it when it is not there. duet itself never
 * downloads anything. */
#define CLI_DEFAULT_MODEL "SmolLM2-135M-Instruct.Q4_1.gguf"
const char *cli_default_model(void);

#endif
