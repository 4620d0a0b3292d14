package tpm

// NodeConfig is the tpm section of the node configuration: the TPM to use
// and the node half's settings.
type NodeConfig struct {
	// Device is the TPM to use: a character device (default /dev/tpmrm0,
	// the kernel's resource manager), unix:///path or tcp://host:port for a
	// socket TPM such as swtpm. Test builds also accept "simulator".
	Device string `json:"device,omitempty"`
	// EndorsementKeys lists EK kinds to prefer (rsa2048, ecc-p256,
	// ecc-p384); by default the first with a certificate in that order.
	EndorsementKeys []string `json:"endorsementKeys,omitempty"`
	// PCRBank and PCRs are what the quote of TPM evidence v2 covers: a bank
	// (sha1, sha256, sha384, sha512; default sha256) and PCR numbers
	// (default 0-9). A Cluster whose boot-state policy names other PCRs
	// needs them here.
	PCRBank string `json:"pcrBank,omitempty"`
	PCRs    []int  `json:"pcrs,omitempty"`
	// EventLogPath is the measured-boot event log sent with the quote
	// (default /sys/kernel/security/tpm0/binary_bios_measurements; a
	// missing file sends none). NoEventLog sends none even where there is
	// one.
	EventLogPath string `json:"eventLogPath,omitempty"`
	NoEventLog   bool   `json:"noEventLog,omitempty"`
}

// AttestorConfig returns the node half's settings.
func (c NodeConfig) AttestorConfig() AttestorConfig {
	var prefer []EKKind
	for _, k := range c.EndorsementKeys {
		prefer = append(prefer, EKKind(k))
	}
	return AttestorConfig{EndorsementKeys: prefer, PCRBank: c.PCRBank, PCRs: c.PCRs, EventLogPath: c.EventLogPath, NoEventLog: c.NoEventLog}
}
