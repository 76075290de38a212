package instance_test

import (
	"errors"
	"net"
	"strconv"
	"syscall"
	"testing"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model"
)

// TestTransferPort: with --kv-transfer-port each data-parallel rank's transfer agent listens on
// that port plus its rank, as the side channel does, so that a network policy can name them; a
// range past 65535 is a configuration error.
func TestTransferPort(t *testing.T) {
	m, err := model.Open(t.Context(), model.Tiny, model.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	cfg := instance.Config{OpenedModel: m, Host: "127.0.0.1", NumBlocks: 64, MaxModelLen: 512,
		KVTransfer: connector.DefaultConfig(connector.RoleProducer), SideChannelPort: -1, DataParallelSize: 2}
	var in *instance.Instance
	for attempt := 0; ; attempt++ {
		cfg.TransferPort = freePortPair(t)
		if in, err = instance.Start(t.Context(), cfg); err == nil {
			break
		}
		if !errors.Is(err, syscall.EADDRINUSE) || attempt == 4 {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { in.Close() })
	for i, rk := range in.Ranks {
		tcp, _ := rk.Connector.Agent().Addrs()
		if want := net.JoinHostPort("127.0.0.1", strconv.Itoa(cfg.TransferPort+i)); tcp != want {
			t.Errorf("rank %d's transfer agent listens on %s; want %s", i, tcp, want)
		}
	}
	cfg.TransferPort = 65535
	if _, err := instance.Start(t.Context(), cfg); !errors.Is(err, instance.ErrConfig) {
		t.Errorf("transfer ports past 65535: %v; want ErrConfig", err)
	}
}
