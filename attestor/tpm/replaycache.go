package tpm

import (
	"crypto/sha256"
	"encoding/binary"
	"sync"
)

// replayCacheSize bounds the boot states a Verifier remembers: enough for
// every join in flight between its two rounds on a busy controller; a miss
// only replays again.
const replayCacheSize = 64

// replayCache remembers the boot states of event logs that replayed, by a
// digest of the log and the PCR values it was replayed against, so that a
// join replays its log once, not once per round (and once more for the
// fresh quote). ReplayEventLog is a function of exactly these inputs, so a
// hit is the state a replay would derive. Failures are not remembered. The
// zero value is ready to use and safe for concurrent use; the states it
// hands out are shared and must not be modified.
type replayCache struct {
	mu     sync.Mutex
	states map[[sha256.Size]byte]*BootState
	order  [][sha256.Size]byte // oldest first
}

// replay returns ReplayEventLog(rawLog, pcrs), remembered.
func (c *replayCache) replay(rawLog []byte, pcrs []PCRValue) (*BootState, error) {
	key := replayKey(rawLog, pcrs)
	c.mu.Lock()
	st, ok := c.states[key]
	c.mu.Unlock()
	if ok {
		return st, nil
	}
	st, err := ReplayEventLog(rawLog, pcrs)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.states[key]; ok {
		return st, nil
	}
	if c.states == nil {
		c.states = make(map[[sha256.Size]byte]*BootState, replayCacheSize)
	}
	if len(c.order) == replayCacheSize {
		delete(c.states, c.order[0])
		c.order = append(c.order[:0], c.order[1:]...)
	}
	c.states[key] = st
	c.order = append(c.order, key)
	return st, nil
}

// replayKey digests everything a replay depends on, each part length
// prefixed, the PCR values in their order.
func replayKey(rawLog []byte, pcrs []PCRValue) [sha256.Size]byte {
	h := sha256.New()
	var n [8]byte
	field := func(b []byte) {
		binary.BigEndian.PutUint64(n[:], uint64(len(b)))
		h.Write(n[:])
		h.Write(b)
	}
	field(rawLog)
	binary.BigEndian.PutUint64(n[:], uint64(len(pcrs)))
	h.Write(n[:])
	for _, p := range pcrs {
		field([]byte(p.Bank))
		binary.BigEndian.PutUint64(n[:], uint64(int64(p.Index)))
		h.Write(n[:])
		field(p.Digest)
	}
	var key [sha256.Size]byte
	h.Sum(key[:0])
	return key
}
