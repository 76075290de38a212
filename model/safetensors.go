package model

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvbridge/kvbridge/model/kernel"
)

// safetensors is one memory-mapped .safetensors file: an 8-byte little-endian header length, a
// JSON header (tensor name → dtype, shape, data_offsets) and the raw tensor bytes.
type safetensors struct {
	path    string
	mapped  []byte // the whole file, read-only mapping
	data    []byte // the byte buffer after the header
	tensors map[string]tensorInfo

	closeOnce sync.Once
	closeErr  error
}

// tensorInfo is one header entry.
type tensorInfo struct {
	DType   string   `json:"dtype"`
	Shape   []int    `json:"shape"`
	Offsets [2]int64 `json:"data_offsets"`
}

// maxHeaderBytes bounds the JSON header (the format's reference implementation uses 100 MB).
const maxHeaderBytes = 100 << 20

// openSafetensors maps path and parses its header. The caller must Close it.
func openSafetensors(path string) (*safetensors, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadWeights, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadWeights, err)
	}
	size := st.Size()
	if size < 8 {
		return nil, fmt.Errorf("%w: %s: %d bytes is too short for a safetensors file", ErrBadWeights, path, size)
	}
	if int64(int(size)) != size {
		return nil, fmt.Errorf("%w: %s: too large to map", ErrBadWeights, path)
	}
	mapped, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("%w: mmap %s: %w", ErrBadWeights, path, err)
	}
	s := &safetensors{path: path, mapped: mapped}
	if err := s.parse(); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// parse reads and validates the header.
func (s *safetensors) parse() error {
	n := binary.LittleEndian.Uint64(s.mapped[:8])
	if n > maxHeaderBytes || n > uint64(len(s.mapped)-8) {
		return fmt.Errorf("%w: %s: header length %d exceeds the file (%d bytes)", ErrBadWeights, s.path, n, len(s.mapped))
	}
	header := s.mapped[8 : 8+n]
	s.data = s.mapped[8+n:]
	var raw map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(header))
	if err := dec.Decode(&raw); err != nil {
		return fmt.Errorf("%w: %s: header: %w", ErrBadWeights, s.path, err)
	}
	s.tensors = make(map[string]tensorInfo, len(raw))
	for name, msg := range raw {
		if name == "__metadata__" {
			continue
		}
		var t tensorInfo
		if err := json.Unmarshal(msg, &t); err != nil {
			return fmt.Errorf("%w: %s: tensor %q: %w", ErrBadWeights, s.path, name, err)
		}
		size, ok := dtypeSize(t.DType)
		if !ok {
			// Unknown dtypes are rejected only if the tensor is actually read.
			s.tensors[name] = t
			continue
		}
		numel := int64(1)
		for _, d := range t.Shape {
			if d < 0 || (d > 0 && numel > math.MaxInt64/int64(d)) {
				return fmt.Errorf("%w: %s: tensor %q: bad shape %v", ErrBadWeights, s.path, name, t.Shape)
			}
			numel *= int64(d)
		}
		b, e := t.Offsets[0], t.Offsets[1]
		if b < 0 || e < b || e > int64(len(s.data)) || e-b != numel*int64(size) {
			return fmt.Errorf("%w: %s: tensor %q: data_offsets %v do not fit shape %v of %s in %d data bytes",
				ErrBadWeights, s.path, name, t.Offsets, t.Shape, t.DType, len(s.data))
		}
		s.tensors[name] = t
	}
	return nil
}

// dtypeSize returns the element size of the dtypes this reader widens to float32.
func dtypeSize(dtype string) (int, bool) {
	switch dtype {
	case "F32":
		return 4, true
	case "F16", "BF16":
		return 2, true
	}
	return 0, false
}

// tensor returns the header entry and raw bytes of tensor name, checking its dtype is one this
// reader widens.
func (s *safetensors) tensor(name string) (tensorInfo, []byte, error) {
	t, ok := s.tensors[name]
	if !ok {
		return t, nil, fmt.Errorf("%w: %s in %s", ErrMissingTensor, name, s.path)
	}
	if _, ok := dtypeSize(t.DType); !ok {
		return t, nil, fmt.Errorf("%w: tensor %s in %s has dtype %q (supported: F32, F16, BF16)", ErrUnsupported, name, s.path, t.DType)
	}
	return t, s.data[t.Offsets[0]:t.Offsets[1]], nil
}

// float32s returns tensor name widened to float32, and its shape.
func (s *safetensors) float32s(name string) ([]float32, []int, error) {
	t, src, err := s.tensor(name)
	if err != nil {
		return nil, nil, err
	}
	size, _ := dtypeSize(t.DType)
	out := make([]float32, len(src)/size)
	widen(out, src, t.DType)
	return out, t.Shape, nil
}

// matrix returns the 2-D tensor name as a matrix reading the mapping (it must not be used after
// Close), and the tensor's shape.
func (s *safetensors) matrix(name string) (matrix, []int, error) {
	t, src, err := s.tensor(name)
	if err != nil {
		return matrix{}, nil, err
	}
	if len(t.Shape) != 2 {
		return matrix{}, t.Shape, nil
	}
	return matrix{raw: src, dtype: t.DType, cols: t.Shape[1]}, t.Shape, nil
}

// widen converts little-endian src of dtype into dst (len(dst) elements).
func widen(dst []float32, src []byte, dtype string) {
	switch dtype {
	case "F32":
		for i := range dst {
			dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
		}
	case "BF16":
		for i := range dst {
			dst[i] = kernel.BF16ToF32(binary.LittleEndian.Uint16(src[2*i:]))
		}
	case "F16":
		for i := range dst {
			dst[i] = kernel.F16ToF32(binary.LittleEndian.Uint16(src[2*i:]))
		}
	}
}

// Close unmaps the file. It is idempotent.
func (s *safetensors) Close() error {
	s.closeOnce.Do(func() {
		if s.mapped != nil {
			s.closeErr = unix.Munmap(s.mapped)
			s.mapped, s.data = nil, nil
		}
	})
	return s.closeErr
}
