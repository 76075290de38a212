package connector

import (
	"fmt"
	"slices"
	"strings"
)

// envAllowUnknownConfig, when set to 1 (or true), downgrades an unknown --kv-transfer-config
// key from a start-up error to a warning: the escape hatch for a config written for another
// vLLM version whose keys kvbridge does not know yet.
const envAllowUnknownConfig = "KVBRIDGE_ALLOW_UNKNOWN_KV_CONFIG"

// The keys of --kv-transfer-config. A key in neither list of its level is unknown: a start-up
// error naming the nearest known key, unless envAllowUnknownConfig is set.
var (
	// topKeys are the top-level keys kvbridge implements.
	topKeys = []string{"kv_connector", "kv_role", "engine_id", "kv_load_failure_policy", "enable_permute_local_kv",
		"kv_buffer_device", "kv_connector_extra_config"}
	// vllmTopKeys are vLLM's KVTransferConfig keys with no meaning here: accepted with a warning.
	vllmTopKeys = []string{"kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port",
		"kv_connector_module_path", "enable_cross_layers_blocks"}
	// extraKeys are the kv_connector_extra_config keys kvbridge implements.
	extraKeys = []string{"backends", "kv_lease_duration", "bidirectional_kv_xfer", "kv_recompute_threshold",
		"decoder_kv_blocks_ttl", "enforce_handshake_compat", "engine_ttl", "num_threads", "auth_token", "allowed_peers",
		"push_layerwise"}
	// vllmExtraKeys are kv_connector_extra_config keys of vLLM's NixlConnector with no meaning here.
	vllmExtraKeys = []string{"enable_cross_layers_blocks"}
)

// unknownKeyError refuses an unknown key of a level (name is its full dotted name), with
// unknownKeyHint.
func unknownKeyError(key, name string, top bool) error {
	return fmt.Errorf("%w: unknown key %s (%s); set %s=1 to ignore unknown keys with a warning", ErrConfig, clip(name), unknownKeyHint(key, top), envAllowUnknownConfig)
}

// unknownKeyHint names the nearest known key to an unknown one: of the same level, or of the
// other one (a key put at the wrong level); or lists the level's keys.
func unknownKeyHint(key string, top bool) string {
	same, other := append(slices.Clone(topKeys), vllmTopKeys...), extraKeys
	where := "inside kv_connector_extra_config"
	if !top {
		same, other = append(slices.Clone(extraKeys), vllmExtraKeys...), topKeys
		where = "at the top level of --kv-transfer-config"
	}
	if slices.Contains(other, key) {
		return fmt.Sprintf("%s belongs %s", key, where)
	}
	if near, ok := nearestKey(key, same); ok {
		return fmt.Sprintf("did you mean %s?", near)
	}
	if near, ok := nearestKey(key, other); ok {
		return fmt.Sprintf("did you mean %s, %s?", near, where)
	}
	return "known keys: " + strings.Join(same, ", ")
}

// nearestKey returns the candidate closest to key in edit distance, if it is close enough to be
// a typo: at most a third of the key's length, and at least 1, edits away.
func nearestKey(key string, candidates []string) (string, bool) {
	best, bestDist := "", -1
	for _, c := range candidates {
		if d := levenshtein(strings.ToLower(key), c); bestDist < 0 || d < bestDist {
			best, bestDist = c, d
		}
	}
	return best, bestDist >= 0 && bestDist <= max(1, len(key)/3)
}

// levenshtein returns the edit distance (insertions, deletions, substitutions) between a and b.
func levenshtein(a, b string) int {
	if len(a) > 256 || len(b) > 256 {
		return max(len(a), len(b)) // an untrusted key: no quadratic work on it
	}
	prev, cur := make([]int, len(b)+1), make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
