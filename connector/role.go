package connector

import "fmt"

// CheckRole refuses kv_transfer_params that ask this engine for a leg its kv_role cannot serve,
// so that a misconfigured deployment fails loudly instead of silently recomputing every prompt:
//
//   - a kv_consumer (a decode instance) asked to prefill for a remote decoder
//     (do_remote_decode=true): the proxy's prefill and decode instances are likely swapped;
//   - a kv_producer (a prefill instance) handed complete params to pull
//     (do_remote_prefill=true with the remote fields): likewise.
//
// kv_both serves both legs. Bidirectional mode stays legal: there the producer receives the
// decoder's params with do_remote_decode=true (it prefills for D and pulls D's history), and
// the consumer receives the producer's with do_remote_prefill=true. vLLM's NixlConnector
// ignores kv_role (the proxy alone decides who prefills); kvbridge refuses instead (see
// docs/architecture.md). Params that do not parse are left to the checks that already warn about
// them; nil params pass.
func (c *Connector) CheckRole(raw map[string]any) error {
	return checkRole(c.cfg.Role, raw)
}

// checkRole is CheckRole for role.
func checkRole(role Role, raw map[string]any) error {
	p, err := ParseParams(raw)
	if err != nil || p == nil {
		return nil
	}
	switch {
	case role == RoleConsumer && p.DoRemoteDecode:
		return fmt.Errorf("%w: this engine is a kv_consumer (a decode instance) and was asked to prefill for a remote decoder "+
			"(kv_transfer_params.do_remote_decode=true); send prefill legs to a kv_producer — are the proxy's prefill and decode "+
			"instances swapped? — or start this engine with kv_role kv_producer (or kv_both)", ErrWrongRole)
	case role == RoleProducer && p.DoRemotePrefill && p.Complete():
		return fmt.Errorf("%w: this engine is a kv_producer (a prefill instance) and was handed a producer's params to pull "+
			"(kv_transfer_params.do_remote_prefill=true); send decode legs to a kv_consumer — are the proxy's prefill and decode "+
			"instances swapped? — or start this engine with kv_role kv_consumer (or kv_both)", ErrWrongRole)
	}
	return nil
}
