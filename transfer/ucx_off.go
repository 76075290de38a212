//go:build !ucx || !cgo

package transfer

import (
	"context"
	"time"
)

// ucxBuilt reports whether this binary has the UCX backend: built without -tags ucx (or
// without cgo), it does not, and ParseBackends refuses "UCX" naming the tag.
const ucxBuilt = false

// ucxEngine is never created in this build (Agent.ucx stays nil).
type ucxEngine struct{}

// ucxLink is never created in this build.
type ucxLink struct{}

func newUCXEngine(*Agent) (*ucxEngine, error) {
	return nil, newErr("agent", "", ErrNotSupported, "this binary was built without -tags ucx", nil)
}

func (*ucxEngine) close()                                           {}
func (*ucxEngine) workerAddrs() [][]byte                            { return nil }
func (*ucxEngine) numWorkers() int                                  { return 1 }
func (*ucxEngine) unmapArena(*ucxMapping)                           {}
func (*ucxEngine) dispatch(*ucxLink, *Request, uint64)              {}
func (*ucxEngine) mapArena(*Arena) (*ucxMapping, error)             { return nil, errNoUCX() }
func (*ucxEngine) connect(context.Context, *peer) (*ucxLink, error) { return nil, errNoUCX() }
func (*ucxEngine) sendInbound(context.Context, string, []byte, time.Time) (bool, error) {
	return false, nil
}
func (*ucxLink) transports() []string                              { return nil }
func (*ucxLink) close()                                            {}
func (*ucxLink) abort(string)                                      {}
func (*ucxLink) drain(string)                                      {}
func (*ucxLink) send([]byte, time.Time) error                      { return errNoUCX() }
func (*ucxLink) sendAsync(_ []byte, _ time.Time, done func(error)) { done(errNoUCX()) }

// errNoUCX is the error of any UCX use in this build.
func errNoUCX() error {
	return newErr("ucx", "", ErrNotSupported, "this binary was built without -tags ucx", nil)
}
