package connector

import "fmt"

// kvDTypeMismatch returns err, or an error naming both KV dtypes when remote (what producer id
// reported in its handshake payload; "" when it did not say) differs from this engine's: a
// consumer reads the producer's blocks byte for byte, so --kv-cache-dtype must be the same on
// both (a bfloat16 block is twice an FP8 one; fp8_e4m3 and fp8_e5m2 blocks have the same size
// and only this check tells them apart when enforce_handshake_compat is off). A hash mismatch
// (err) that the dtypes explain is wrapped with them; with err nil a mismatch is ErrIncompatible.
func (c *Connector) kvDTypeMismatch(id, remote string, err error) error {
	local := c.geo.DType.String()
	if remote == "" || remote == local {
		return err
	}
	const why = "--kv-cache-dtype must be the same on the prefill and the decode engine"
	if err != nil {
		return fmt.Errorf("%w; the KV cache dtypes differ: engine %s holds %s KV, this engine %s (%s)", err, id, remote, local, why)
	}
	return fmt.Errorf("%w: engine %s holds %s KV, this engine %s (%s)", ErrIncompatible, id, remote, local, why)
}

// transferModeMismatch returns err, or an error naming both transfer modes when remote (what
// engine id reported in its handshake payload) differs from this engine's: a pull decoder
// cannot read from a push prefiller's protocol and the other way round, so kv_connector must
// be NixlPushConnector on both or on neither. The mode is part of the compatibility hash; this
// names the cause of the mismatch, and refuses it even with enforce_handshake_compat off.
func (c *Connector) transferModeMismatch(id, remote string, err error) error {
	local := c.cfg.TransferMode()
	if remote == "" || remote == local {
		return err
	}
	const why = "P and D must both run kv_connector NixlPushConnector, or both NixlConnector/NixlPullConnector"
	if err != nil {
		return fmt.Errorf("%w; the transfer modes differ: engine %s runs transfer_mode %s, this engine %s (%s)", err, id, remote, local, why)
	}
	return fmt.Errorf("%w: engine %s runs transfer_mode %s, this engine %s (%s)", ErrIncompatible, id, remote, local, why)
}
