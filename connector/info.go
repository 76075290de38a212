package connector

// Info is what an engine tells of its connector at GET /v1/kv_transfer, for operators and
// `kvbridge check`: its configuration (never the auth token itself) and how its transfers went.
type Info struct {
	// Connector is kv_connector ("NixlConnector").
	Connector string `json:"kv_connector"`
	// Role is kv_role.
	Role Role `json:"kv_role"`
	// EngineID is engine_id (with several data-parallel ranks, rank 0's).
	EngineID string `json:"engine_id"`
	// RemoteHost, RemotePort and TPSize are what this engine puts into the kv_transfer_params
	// it issues (remote_host, remote_port: its side channel; tp_size), so that a proxy sending
	// both legs of a push at once can address the decoder to this prefiller before it answers.
	RemoteHost string `json:"remote_host"`
	RemotePort int    `json:"remote_port"`
	TPSize     int    `json:"tp_size"`
	// TransferMode is "push" (kv_connector NixlPushConnector) or "pull".
	TransferMode string `json:"transfer_mode"`
	// PushParked counts the push registrations waiting for their request (a push_id whose
	// prefill has not finished here yet), at most 1024, each at most kv_lease_duration.
	PushParked int `json:"push_registrations_parked"`
	// Bidirectional is kv_connector_extra_config.bidirectional_kv_xfer.
	Bidirectional bool `json:"bidirectional_kv_xfer"`
	// AuthToken says whether an auth token is set (the config key or KVBRIDGE_KV_AUTH_TOKEN).
	AuthToken bool `json:"auth_token"`
	// CompatibilityHash is the hash the handshake compares (model, dtypes, geometry), and
	// Compatibility what it hashes (CompatFactors.Fields), so that two engines whose hashes
	// differ show in what.
	CompatibilityHash string         `json:"compatibility_hash"`
	Compatibility     map[string]any `json:"compatibility"`
	// EnforceHandshakeCompat is enforce_handshake_compat.
	EnforceHandshakeCompat bool `json:"enforce_handshake_compat"`
	// Backends is kv_connector_extra_config.backends; empty means automatic (SHM, then TCP).
	Backends []string `json:"backends"`
	// MappedBytes counts the bytes of producers' arenas this engine mapped (its pulls go over
	// SHM); ServedTCPReadBytes the bytes peers read from this engine over TCP.
	MappedBytes        int64 `json:"mapped_bytes"`
	ServedTCPReadBytes int64 `json:"served_tcp_read_bytes"`
	// BytesRead counts the bytes this engine pulled, over any backend.
	BytesRead int64 `json:"bytes_read"`
	// BytesWritten counts the bytes this engine pushed into peers' blocks (push mode, P), over
	// any backend; ServedTCPWriteBytes the bytes peers wrote into this engine over TCP (D).
	BytesWritten        int64 `json:"bytes_written"`
	ServedTCPWriteBytes int64 `json:"served_tcp_write_bytes"`
	// Refusals are the authentication and authorization refusals so far.
	Refusals AuthRefusals `json:"refusals"`
	// ParamsAuthMismatch counts the params of Refusals.Params refused for their MAC: issued by
	// an engine whose auth token differs from this one's (or that has none while this one has).
	ParamsAuthMismatch int64 `json:"params_auth_mismatch"`
}

// Info returns what GET /v1/kv_transfer reports of this connector.
func (c *Connector) Info() Info {
	st := c.agent.Stats()
	var parked int
	c.locked(func() { parked = len(c.core.push.parked) })
	return Info{
		Connector: c.cfg.Connector, Role: c.cfg.Role, EngineID: c.cfg.EngineID, Bidirectional: c.cfg.Bidirectional,
		RemoteHost: c.core.host, RemotePort: c.core.port, TPSize: c.pool.TensorParallelSize(), TransferMode: c.cfg.TransferMode(),
		AuthToken: c.auth != nil, CompatibilityHash: c.hash, Compatibility: c.compat.Fields(), EnforceHandshakeCompat: c.cfg.EnforceHandshakeCompat,
		Backends: c.cfg.Backends, MappedBytes: st.MappedBytes, ServedTCPReadBytes: st.ServedReadBytes, BytesRead: st.BytesRead, BytesWritten: st.BytesWritten, ServedTCPWriteBytes: st.ServedWriteBytes,
		Refusals: c.AuthRefusals(), ParamsAuthMismatch: c.counts.paramsMAC.Load(), PushParked: parked,
	}
}
