package connector

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestParseConfigSeedGuide(t *testing.T) {
	c, err := ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_load_failure_policy":"fail",
		"enable_permute_local_kv":"True",
		"kv_connector_extra_config":{"backends":["TCP"],"kv_lease_duration":60,"bidirectional_kv_xfer":true,"decoder_kv_blocks_ttl":600}}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.Role != RoleProducer || c.LoadFailurePolicy != PolicyFail || !c.EnablePermuteLocalKV || !c.Bidirectional {
		t.Errorf("parsed %+v", c)
	}
	if c.threshold() != 64 {
		t.Errorf("bidirectional threshold = %d, want 64", c.threshold())
	}
	if c.LeaseDuration != 60*time.Second || c.DecoderBlocksTTL != 600*time.Second || c.Backends[0] != "TCP" {
		t.Errorf("parsed %+v", c)
	}
	if c.EngineID == "" {
		t.Error("engine_id not defaulted to a UUID")
	}
}

func TestParseConfigDefaults(t *testing.T) {
	c, err := ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.LoadFailurePolicy != PolicyFail || c.LeaseDuration != 30*time.Second || c.threshold() != 0 ||
		c.DecoderBlocksTTL != 480*time.Second || !c.EnforceHandshakeCompat || c.EngineTTL != time.Hour {
		t.Errorf("defaults = %+v", c)
	}
}

// TestDefaultConfig: DefaultConfig(role) is what the minimal --kv-transfer-config of that role
// parses to (the seed guide's defaults, checked above), each with an engine id of its own.
func TestDefaultConfig(t *testing.T) {
	for _, role := range []Role{RoleProducer, RoleConsumer} {
		parsed, err := ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"`+string(role)+`"}`), nil)
		if err != nil {
			t.Fatal(err)
		}
		c, other := DefaultConfig(role), DefaultConfig(role)
		if c.EngineID == "" || c.EngineID == other.EngineID {
			t.Errorf("%s: engine ids %q and %q, want two fresh ones", role, c.EngineID, other.EngineID)
		}
		c.EngineID = parsed.EngineID
		if !reflect.DeepEqual(c, parsed) {
			t.Errorf("%s: DefaultConfig = %+v, ParseConfig = %+v", role, c, parsed)
		}
		if !c.Enabled() {
			t.Errorf("%s: DefaultConfig configures no connector", role)
		}
	}
}

// TestParseConfigErrors checks that each bad value is refused with a message naming its key.
func TestParseConfigErrors(t *testing.T) {
	for doc, key := range map[string]string{
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"kv_lease_duration":"soon"}}`:   "kv_lease_duration",
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"backends":["LIBFABRIC"]}}`:     "not available in this build",
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"backends":["RDMA"]}}`:          "unknown backend",
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"backends":["TCP","tcp"]}}`:     "listed twice",
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"backends":"x y"}}`:             "",
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"bidirectional_kv_xfer":3}}`:    "bidirectional_kv_xfer",
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":[]}`:                             "kv_connector_extra_config",
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_load_failure_policy":"retry"}`:                           "kv_load_failure_policy",
		`{"kv_connector":"NixlConnector","kv_role":"decoder"}`:                                                                "kv_role",
		`{"kv_connector":"LMCacheConnector","kv_role":"kv_producer"}`:                                                         "kv_connector",
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"kv_recompute_threshold":1.5}}`: "kv_recompute_threshold",
		`null`: "JSON object",
		`[`:    "JSON object",
	} {
		_, err := ParseConfig([]byte(doc), nil)
		if key == "" {
			// "x y" is a single backend name, unknown: still an error.
			if err == nil {
				t.Errorf("ParseConfig(%s) succeeded", doc)
			}
			continue
		}
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), key) {
			t.Errorf("ParseConfig(%s) error = %v, want ErrConfig naming %q", doc, err, key)
		}
	}
}

// TestParseConfigWithoutConnector: as in vLLM, a config that names no connector (the seed
// guide's partial examples) configures none.
func TestParseConfigWithoutConnector(t *testing.T) {
	var log strings.Builder
	c, err := ParseConfig([]byte(`{"kv_connector_extra_config": {"kv_lease_duration": 60}}`), testLogger(&log))
	if err != nil || c.Enabled() || !strings.Contains(log.String(), "KV transfer is off") {
		t.Fatalf("config without kv_connector: %+v, %v, log %q", c, err, log.String())
	}
}

func TestParseConfigKVBothWarns(t *testing.T) {
	var log strings.Builder
	c, err := ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_size":1e9}`), testLogger(&log))
	if err != nil || c.Role != RoleBoth {
		t.Fatalf("kv_both refused: %v", err)
	}
	if !strings.Contains(log.String(), "deprecated") || !strings.Contains(log.String(), "kv_buffer_size") {
		t.Errorf("log = %q, want the kv_both deprecation and the ignored vLLM key", log.String())
	}
}

// FuzzParseConfig: any document is either a valid config or an ErrConfig naming what is wrong;
// never a panic.
func FuzzParseConfig(f *testing.F) {
	f.Add(`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_load_failure_policy":"fail"}`)
	f.Add(`{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"backends":["TCP","SHM"],"kv_lease_duration":60,"bidirectional_kv_xfer":"True"}}`)
	f.Add(`{"kv_connector":"NixlConnector","kv_role":"kv_both","enable_permute_local_kv":"True","kv_connector_extra_config":{"decoder_kv_blocks_ttl":1e400}}`)
	f.Fuzz(func(t *testing.T, doc string) {
		c, err := ParseConfig([]byte(doc), nil)
		if err != nil {
			if !errors.Is(err, ErrConfig) {
				t.Fatalf("error %v is not ErrConfig", err)
			}
			return
		}
		if c.Enabled() && (c.EngineID == "" || c.LeaseDuration < time.Second) {
			t.Fatalf("accepted config has no engine id or a lease under a second: %+v", c)
		}
	})
}

// TestParseConfigUnknownKeys: a typo in a key is a start-up error naming the nearest known key
// (at the right level), not a warning after which the engine serves without a connector; vLLM's
// keys that kvbridge does not use still start, with a warning; KVBRIDGE_ALLOW_UNKNOWN_KV_CONFIG=1
// makes unknown keys warnings.
func TestParseConfigUnknownKeys(t *testing.T) {
	for doc, want := range map[string]string{
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_conector_extra_config":{"kv_lease_duration":60}}`:   "unknown key kv_conector_extra_config (did you mean kv_connector_extra_config?)",
		`{"kv_connector":"NixlConnector","kv_rol":"kv_producer"}`:                                                        "did you mean kv_role?",
		`{"kv_conector":"NixlConnector","kv_role":"kv_producer"}`:                                                        "did you mean kv_connector?",
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"kv_lease_duratoin":60}}`:  "unknown key kv_connector_extra_config.kv_lease_duratoin (did you mean kv_lease_duration?)",
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","bidirectional_kv_xfer":true}`:                          "bidirectional_kv_xfer belongs inside kv_connector_extra_config",
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"kv_role":"kv_producer"}}`: "kv_role belongs at the top level",
		`{"kv_connector":"NixlConnector","kv_role":"kv_producer","zzz":1}`:                                               "known keys: kv_connector, kv_role",
	} {
		_, err := ParseConfig([]byte(doc), nil)
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), envAllowUnknownConfig+"=1") {
			t.Errorf("ParseConfig(%s) error = %v, want ErrConfig saying %q and the escape hatch", doc, err, want)
		}
	}

	var log strings.Builder
	c, err := ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_size":1e9,"kv_ip":"10.0.0.1","kv_port":14579,"kv_rank":1}`), testLogger(&log))
	if err != nil || !c.Enabled() || !strings.Contains(log.String(), "kv_buffer_size") {
		t.Errorf("vLLM's unused keys: %+v, %v, log %q; want a connector and a warning", c, err, log.String())
	}

	t.Setenv(envAllowUnknownConfig, "1")
	log.Reset()
	c, err = ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"future_knob":1}}`), testLogger(&log))
	if err != nil || !c.Enabled() || !strings.Contains(log.String(), "future_knob") {
		t.Errorf("with %s=1: %+v, %v, log %q; want a connector and a warning naming the key", envAllowUnknownConfig, c, err, log.String())
	}
}

func TestLevenshtein(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		d    int
	}{{"", "", 0}, {"kv_rol", "kv_role", 1}, {"kitten", "sitting", 3}, {"abc", "", 3}, {"flaw", "lawn", 2}} {
		if got := levenshtein(tc.a, tc.b); got != tc.d {
			t.Errorf("levenshtein(%q, %q) = %d, want %d", tc.a, tc.b, got, tc.d)
		}
	}
}
