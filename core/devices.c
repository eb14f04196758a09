/* devices.c — every backend and device, or why a backend is unavailable. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../backends/backend.h"

static const char *device_type_name(duet_device_type t) {
    switch (t) {
    case DUET_DEVICE_DISCRETE_GPU: return "discrete-gpu";
    case DUET_DEVICE_INTEGRATED_GPU: return "integrated-gpu";
    case DUET_DEVICE_CPU: return "cpu-device";
    case DUET_DEVICE_HOST: return "host";
    case DUET_DEVICE_OTHER: return "other";
    }
    return "other";
}

size_t duet_devices_describe(char *buf, size_t size, bool json) {
    cJSON *arr = cJSON_CreateArray();
    /* The text grows with the devices (a fixed buffer would cut it short
     * and misreport the length needed). */
    char *text = NULL;
    size_t text_len = 0;
    FILE *tf = open_memstream(&text, &text_len);
#define OUT(...)                                                                                         \
    do {                                                                                                 \
        if (tf) fprintf(tf, __VA_ARGS__);                                                                \
    } while (0)
    for (int b = 0; b < duet_backend_count(); b++) {
        const duet_backend_iface *be = duet_backend_get(b);
        char why[256] = "";
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "backend", be->name);
        if (!be->available(why, sizeof why)) {
            cJSON_AddBoolToObject(o, "available", false);
            cJSON_AddStringToObject(o, "reason", why);
            cJSON_AddItemToArray(arr, o);
            OUT("%s: unavailable (%s)\n", be->name, why);
            continue;
        }
        cJSON_AddBoolToObject(o, "available", true);
        cJSON *devs = cJSON_AddArrayToObject(o, "devices");
        int nd = be->device_count();
        OUT("%s: %d device%s\n", be->name, nd, nd == 1 ? "" : "s");
        for (int d = 0; d < nd; d++) {
            duet_device_info info;
            if (duet_device_info_get(be, d, &info) != DUET_OK) {
                /* Reported in both forms: JSON readers must not lose it. */
                cJSON *e = cJSON_CreateObject();
                cJSON_AddNumberToObject(e, "index", d);
                cJSON_AddStringToObject(e, "error", duet_last_error());
                cJSON_AddItemToArray(devs, e);
                OUT("  [%d] error: %s\n", d, duet_last_error());
                continue;
            }
            cJSON *e = cJSON_CreateObject();
            cJSON_AddNumberToObject(e, "index", d);
            cJSON_AddStringToObject(e, "name", info.name);
            cJSON_AddStringToObject(e, "vendor", info.vendor);
            cJSON_AddStringToObject(e, "driver", info.driver);
            cJSON_AddStringToObject(e, "type", device_type_name(info.type));
            cJSON_AddNumberToObject(e, "memory_bytes", (double)info.memory_bytes);
            cJSON_AddNumberToObject(e, "compute_units", info.compute_units);
            cJSON_AddBoolToObject(e, "fp16", info.fp16);
            cJSON_AddBoolToObject(e, "int8_dot", info.int8_dot);
            cJSON_AddBoolToObject(e, "coopmat", info.coopmat);
            cJSON_AddBoolToObject(e, "q8_activations", info.q8_activations);
            cJSON_AddNumberToObject(e, "subgroup_size", info.subgroup_size);
            cJSON_AddStringToObject(e, "features", info.features);
            cJSON_AddItemToArray(devs, e);
            OUT("  [%d] %s (%s, %s), %.1f GiB, %d compute units\n      fp16 %s, int8 dot %s, coopmat %s, "
                "subgroup %d; %s\n",
                d, info.name, info.vendor, device_type_name(info.type), (double)info.memory_bytes / (1 << 30),
                info.compute_units, info.fp16 ? "yes" : "no", info.int8_dot ? "yes" : "no",
                info.coopmat ? "yes" : "no", info.subgroup_size, info.features);
        }
        cJSON_AddItemToArray(arr, o);
    }
#undef OUT
    if (tf) fclose(tf);
    char *s = json ? cJSON_PrintUnformatted(arr) : NULL;
    const char *result = json ? s : text;
    size_t need = result ? strlen(result) : 0;
    if (size) snprintf(buf, size, "%s", result ? result : "");
    cJSON_free(s);
    free(text);
    cJSON_Delete(arr);
    return need;
}
