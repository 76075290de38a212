package main

// kvCacheDTypes lists the values --kv-cache-dtype takes, for the messages that refuse others
// (serve, bench engine): vLLM's names, fp8 being fp8_e4m3 as in vLLM.
const kvCacheDTypes = "auto, float32, bfloat16, fp8, fp8_e4m3 or fp8_e5m2"
