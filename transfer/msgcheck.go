package transfer

import (
	"fmt"

	"github.com/kvbridge/kvbridge/internal/msgpackcheck"
)

// checkMsgpack verifies untrusted msgpack before decoding (see package msgpackcheck) and
// returns the number of bytes the value occupies; failures wrap ErrProtocol.
func checkMsgpack(b []byte, maxDepth int) (int, error) {
	n, err := msgpackcheck.Check(b, maxDepth)
	if err != nil {
		return 0, fmt.Errorf("%w: msgpack: %v", ErrProtocol, err)
	}
	return n, nil
}
