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
	if c.Threshold() != 64 {
		t.Errorf("bidirectional threshold = %d, want 64", c.Threshold())
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
	if c.LoadFailurePolicy != PolicyFail || c.LeaseDuration != 30*time.Second || c.Threshold() != 0 ||
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
	c, err := ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"kv_both","surprise":1}`), testLogger(&log))
	if err != nil || c.Role != RoleBoth {
		t.Fatalf("kv_both refused: %v", err)
	}
	if !strings.Contains(log.String(), "deprecated") || !strings.Contains(log.String(), "surprise") {
		t.Errorf("log = %q, want the kv_both deprecation and the unknown key", log.String())
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
